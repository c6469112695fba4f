#!/usr/bin/env bash
# One device call comparing this tree's dtq/ with an earlier commit's on the same lease. Hosts of
# one machine type differ by up to 2x in host speed between leases (docs/benchmarks.md, "The
# planned ops' constants as one int"), so only runs of one call compare. Prepare the earlier tree
# here, then carry it:
#
#   bash bench/ab_round.sh --prepare <commit>      # here: writes .ab_base/{dtq,csrc} (git-ignored)
#   AB="trainer model_step fsdp" bash bench/ab_round.sh   # on the device; carry .ab_base .whl .kcache
#
# Each tree runs with the kernel library of its own csrc/ (a C++ change then counts for the new
# tree only): this tree's from .kcache/ or built first; the base's the same one where the sources
# match, else .ab_base/dtq_kernels.so.xz where .ab_base/csrc.sum names its sources (copy an earlier
# call's keep_kernels output there), else built in the call (2-3 minutes).
#
# A setting against another in one tree: prepare this commit as the base (--prepare HEAD) and give
# each tree's extra trainer arguments, e.g. EXTRA_BASE="--set parallel.fsdp_units=blocks" (and
# EXTRA_NEW for the new tree's).
#
# For each tree in ORDER ("new base new" by default: a first run on a fresh lease has been slow)
# it runs each of AB:
#   trainer     launch/train's CONFIG (launch/configs/llama1b_1gpu.toml), RECIPE (fp8; several, e.g.
#               "fp8 bf16", run one after another for each tree), COMPILE
#               (true), STEPS (30) steps, logging every 10: ms/step per ten steps; on NPROC GPUs
#               (1; more: torchrun, e.g. NPROC=2 CONFIG=launch/configs/llama1b.toml)
#   model_step  bench/model_step.py at CONFIG's shapes, FP8 compiled, no FSDP2
#   fsdp        bench/bench_fsdp.py --preset 1b on one rank, dtq FP8 (BF16 gathers) compiled:
#               ms/step and the host's ms per step
# and then the trainer once under BF16 for the ratio (BF16=0: not). Every run imports the tree
# under test (bench/ copied to /tmp, so the checkout's own dtq/ is not on the path) with
# inductor's caches off: a cached graph would hide a change to a decomposition. Logs in $OUT,
# named <run>-<tree>-<position in ORDER>.txt (-<recipe> appended where RECIPE names several), each
# opening with a host probe (ns a Python dict lookup, just before the run: the lease's host speed);
# the last lines print every trainer run's losses (all digits, from its metrics.jsonl: the GPU
# trainer is not bitwise repeatable run to run, so compare trees over repeated runs,
# ORDER="new new base base") and every run's figures.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ "${1:-}" == "--prepare" ]]; then
  [[ -n "${2:-}" ]] || { echo "usage: bash bench/ab_round.sh --prepare <commit>" >&2; exit 2; }
  rm -rf "$ROOT/.ab_base" && mkdir -p "$ROOT/.ab_base"
  git -C "$ROOT" archive "$2" dtq csrc | tar -x -C "$ROOT/.ab_base" || exit 1
  git -C "$ROOT" rev-parse --short "$2" > "$ROOT/.ab_base/COMMIT"
  echo "base $(cat "$ROOT/.ab_base/COMMIT") in .ab_base/dtq: name .ab_base in the device call's carry"
  exit 0
fi
[[ -d "$ROOT/.ab_base/dtq" ]] || { echo "no .ab_base/dtq: run bash bench/ab_round.sh --prepare <commit> here and carry .ab_base" >&2; exit 2; }
cd "$ROOT" && source bench/device_env.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
CONFIG=$ROOT/${CONFIG:-launch/configs/llama1b_1gpu.toml}
SITE=""  # the carried wheels device_env.sh installed, ahead of the tree under test
[[ ":$PYTHONPATH:" == *":/tmp/site:"* ]] && SITE=/tmp/site:
rm -rf /tmp/ab_bench && cp -r "$ROOT/bench" /tmp/ab_bench
# each tree's kernel library (see the top)
if [[ -z "${DTQ_KERNEL_LIBRARY:-}" ]]; then  # this tree's library, built once for all its runs
  (cd "$ROOT" && python3 -m dtq.kernels build > "$OUT/kernels_build.txt" 2>&1) || {
    echo "this tree's kernel library did not build: $OUT/kernels_build.txt" >&2; exit 1; }
  keep_kernels
  DTQ_KERNEL_LIBRARY=$(ls "$(cd "$ROOT" && python3 -c 'from dtq import kernels; print(kernels.build_dir())')"/dtq_kernels*.so | head -1)
  export DTQ_KERNEL_LIBRARY
fi
BASE_SO=""
_base_sum=$(find "$ROOT/.ab_base/csrc" -maxdepth 1 -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \) \
  2>/dev/null | LC_ALL=C sort | xargs -r cat | sha256sum | cut -c1-16)
if [[ ! -d "$ROOT/.ab_base/csrc" ]]; then
  echo "kernels: .ab_base has no csrc/ (prepared by an older ab_round.sh): both trees use this tree's library"
elif [[ "$_base_sum" == "$_csrc_sum" ]]; then
  echo "kernels: the base's csrc/ is this tree's: one library"
elif [[ -f "$ROOT/.ab_base/dtq_kernels.so.xz" && "$(cat "$ROOT/.ab_base/csrc.sum" 2>/dev/null)" == "$_base_sum" ]]; then
  xz -dkf "$ROOT/.ab_base/dtq_kernels.so.xz" && BASE_SO=$ROOT/.ab_base/dtq_kernels.so
  echo "kernels: the base's carried library (csrc sum $_base_sum)"
else
  echo "kernels: building the base's library from .ab_base/csrc (sum $_base_sum)"
  (cd /tmp && DTQ_KERNEL_BUILD_DIR=/tmp/ab_base_kernels PYTHONPATH="$ROOT/.ab_base" python3 -m dtq.kernels build \
    > "$OUT/base_kernels_build.txt" 2>&1)
  BASE_SO=$(ls /tmp/ab_base_kernels/dtq_kernels*.so 2>/dev/null | head -1)
  [[ -n "$BASE_SO" ]] || { echo "the base's kernel library did not build: $OUT/base_kernels_build.txt" >&2; exit 1; }
fi
echo "base: $(cat "$ROOT/.ab_base/COMMIT"), new: this tree; $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
start=$(date +%s)

run() {  # run <what> <tree> <position> <recipe> [log name suffix]
  local what=$1 tree=$2 pos=$3 recipe=$4 path=$ROOT log so=${DTQ_KERNEL_LIBRARY:-}
  [[ $tree == base ]] && path=$ROOT/.ab_base && so=${BASE_SO:-$so}
  log="$OUT/$what-$tree-$pos${5:-}.txt"
  # the lease's Python speed just before the run: leases differ by up to 2x in host speed, and a
  # slow one makes a host-bound FP8 step slow (compare runs of similar probes only)
  python3 -c 'import time
d = {i: i for i in range(64)}
t = time.perf_counter()
for i in range(1_000_000):
    d.get(i & 63)
print(f"host probe {(time.perf_counter() - t) * 1e3:.0f} ns a lookup")' > "$log"
  local extra=${EXTRA_NEW:-}
  [[ $tree == base ]] && extra=${EXTRA_BASE:-}
  case $what in
    trainer)
      # (word splitting of $extra intended: "--set key=value ...")
      # shellcheck disable=SC2086
      local launcher=(python3)  # NPROC > 1: torchrun on that many GPUs of the lease
      [[ ${NPROC:-1} -gt 1 ]] && launcher=(torchrun --standalone --nproc-per-node "$NPROC")
      (cd /tmp && DTQ_KERNEL_LIBRARY="$so" PYTHONPATH="$SITE$path" "${launcher[@]}" -m dtq.launch.train --config "$CONFIG" --recipe "$recipe" \
        --set train.steps="${STEPS:-30}" --set train.log_every=10 --set train.eval_every=0 \
        --set train.checkpoint_every=0 --set train.compile="${COMPILE:-true}" $extra \
        --out-dir "/tmp/ab_run_${what}_${tree}_${pos}_${recipe}" --overwrite >> "$log" 2>&1)
      local rc=$?
      # the last step still writes a checkpoint (~13 GB at 1.07 B): a few runs fill a lease's 64 GiB
      rm -rf "/tmp/ab_run_${what}_${tree}_${pos}_${recipe}/checkpoints"
      (exit $rc) ;;
    model_step)
      (cd /tmp && DTQ_KERNEL_LIBRARY="$so" PYTHONPATH="$SITE$path" python3 /tmp/ab_bench/model_step.py --config "$CONFIG" fp8c >> "$log" 2>&1) ;;
    fsdp)
      (cd /tmp && DTQ_KERNEL_LIBRARY="$so" PYTHONPATH="$SITE$path" torchrun --standalone --nproc-per-node 1 /tmp/ab_bench/bench_fsdp.py \
        --preset 1b --backward-thread caller --modes "dtq fp8 (bf16 gather) compiled" >> "$log" 2>&1) ;;
    *) echo "unknown AB entry $what (trainer, model_step, fsdp)" >&2; return 2 ;;
  esac
  echo "$what $tree ($pos) rc=$? after $(( $(date +%s) - start )) s"
}

pos=0
for tree in ${ORDER:-new base new}; do
  pos=$((pos + 1))
  for what in ${AB:-trainer}; do
    read -ra recipes <<< "${RECIPE:-fp8}"
    [[ $what == trainer ]] || recipes=("${recipes[0]}")  # model_step and fsdp run once
    for recipe in "${recipes[@]}"; do
      suffix=""
      [[ "$(echo ${RECIPE:-fp8} | wc -w)" -gt 1 ]] && suffix="-$recipe"
      run "$what" "$tree" "$pos" "$recipe" "$suffix"
    done
  done
done
# (not where RECIPE already ran BF16 for each tree)
[[ "${BF16:-1}" != 0 && " ${AB:-trainer} " == *" trainer "* && " ${RECIPE:-fp8} " != *" bf16 "* ]] && run trainer new bf16 bf16
echo "== losses (the trainer's train records in metrics.jsonl, every digit: the trees' bits where the run repeats)"
for d in /tmp/ab_run_trainer_*; do
  [[ -f $d/metrics.jsonl ]] || continue
  echo "$(basename "$d"): $(python3 -c '
import json, sys
print(" ".join(str(r["step"]) + ":" + repr(r["loss"]) for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "train"))
' "$d/metrics.jsonl")"
done
echo "== figures"
for f in "$OUT"/trainer-*.txt "$OUT"/model_step-*.txt "$OUT"/fsdp-*.txt; do
  [[ -f $f ]] || continue
  echo "$(basename "$f" .txt): $(grep -hoE 'host probe [0-9]+ ns|[0-9,.]+ ms/step( wall)?|host ms by rank [0-9.]+' "$f" | tr '\n' ' ')"
done
