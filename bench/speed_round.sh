#!/usr/bin/env bash
# One device call for the end-to-end numbers docs/benchmarks.md quotes: build the kernels, then
# bench/bench_e2e.py (whole Llama-style stacks, BF16 / torchao / dtq, eager and compiled) and the
# example trainer on one GPU (BF16 and dtq recipes, eager and train.compile=true). Logs to $OUT.
#
#   E2E="--hidden 2048 --recipes fp8 mxfp8" TRAIN="bf16 fp8" COMPILE="false true" bash bench/speed_round.sh
#   E2E= TRAIN="bf16 fp8" bash bench/speed_round.sh             # trainer only
#   E2E= FSDP="--preset 1b" NPROC=2 bash bench/speed_round.sh   # bench_fsdp.py's eager-vs-compiled modes
# The kernel library comes back as $OUT/dtq_kernels.so.xz + csrc.sum: carry them in .kcache/ to skip
# the next lease's build (bench/device_env.sh).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export DTQ_COMMIT=${DTQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
start=$(date +%s)
python3 -m dtq.kernels build > "$OUT/build.log" 2>&1 || { echo "kernel build failed:"; tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
keep_kernels
if [[ -n "${FSDP-}" ]]; then
  torchrun --standalone --nproc-per-node "${NPROC:-2}" bench/bench_fsdp.py \
    --modes "$(python3 bench/bench_fsdp.py --compiled-modes)" $FSDP --out "$OUT/fsdp.json" > "$OUT/fsdp.txt" 2>&1
  echo "fsdp rc=$?"; grep -E "ms/step|step .*x|Error" "$OUT/fsdp.txt" | tail -20
  echo "fsdp done after $(( $(date +%s) - start )) s"
fi
if [[ -n "${E2E-"--hidden 2048"}" ]]; then
  python3 bench/bench_e2e.py ${E2E-"--hidden 2048"} --out "$OUT/e2e.json" > "$OUT/e2e.txt" 2>&1
  grep -v "^W1\|^  \|codecache\|Traceback\|self.dump\|TypeError" "$OUT/e2e.txt" | tail -30
  echo "e2e done after $(( $(date +%s) - start )) s"
fi
for recipe in ${TRAIN-}; do
  for c in ${COMPILE:-false}; do
    python3 launch/train.py --config "${CONFIG:-launch/configs/llama300m.toml}" --recipe "$recipe" \
      --set train.steps=${STEPS:-30} --set train.log_every=10 --set train.eval_every=0 \
      --set train.checkpoint_every=0 --set train.compile=$c --out-dir "/tmp/run-$recipe-$c" --overwrite \
      > "$OUT/train-$recipe-$c.txt" 2>&1
    echo "train $recipe compile=$c rc=$? | $(grep -E 'step +[0-9]+' "$OUT/train-$recipe-$c.txt" | tail -1)"
    rm -rf "/tmp/run-$recipe-$c/checkpoints"  # (the last step writes one: ~13 GB at 1.07 B, a lease has 64 GiB of disk)
  done
done
echo "total $(( $(date +%s) - start )) s"
