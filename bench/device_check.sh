#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA kernels, run every GPU test, and with --bench the
# kernel and layer benchmarks. Logs and JSON go to $OUT (default /tmp/dtq_out), which the device
# tool brings back. A torchao wheel in .whl/ (for the layer benchmark's peer rows) is installed
# into /tmp/site first.
#
#   DTQ_COMMIT=<sha> bash bench/device_check.sh            # build + GPU tests (~7 min on an H100)
#   DTQ_COMMIT=<sha> bash bench/device_check.sh --bench    # then bench_kernels and bench_layers
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
start=$(date +%s)
python3 -m dtq.kernels build > "$OUT/build.log" 2>&1 || { echo "kernel build failed:"; tail -30 "$OUT/build.log"; }
echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_cuda_reference.py \
  tests/kernels/test_gpu_compile.py tests/nn/test_gemm.py tests/nn/test_swiglu.py tests/tensor/test_dispatch.py \
  tests/tensor/test_inplace.py tests/formats/test_float8_rowwise.py tests/formats/test_nvfp4_options.py \
  tests/parallel/test_recompute_matrix.py tests/parallel/test_correctness_regressions.py \
  tests/nn/test_linear_plan.py tests/nn/test_host_path.py tests/nn/test_compile.py tests/nn/test_size_rule.py \
  tests/kernels/test_transposed_codes.py \
  tests/nn/test_compile_fullgraph.py::test_autocast_off_recompiles_a_quantized_parameter_model \
  tests/nn/test_compile_fullgraph.py::test_compiled_gemms_reading_one_input_quantize_it_once \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? after $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
if [[ "${1:-}" == "--bench" ]]; then
  python3 bench/bench_kernels.py --out "$OUT/kernels.json" --sizes 64 1024 > "$OUT/kernels.txt" 2>&1
  tail -40 "$OUT/kernels.txt"
  python3 bench/bench_layers.py --out "$OUT/layers.json" > "$OUT/layers.txt" 2>&1
  tail -30 "$OUT/layers.txt"
fi
