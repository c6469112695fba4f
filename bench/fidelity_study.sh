#!/usr/bin/env bash
# Recipe fidelity study (issue 19): the 1.07 B decoder on ONE GPU (launch/configs/llama1b_1gpu.toml,
# 300 steps), one trainer run per recipe with the same config, seed and data order. Each run's
# metrics log goes to $OUT/<recipe>.jsonl and its console to $OUT/<recipe>.log; then
# bench/fidelity_summary.py writes $OUT/fidelity.md, $OUT/fidelity.json and (with matplotlib)
# $OUT/fidelity.png for this call's runs. A device call holds a few recipes; summarise the logs of
# several calls together afterwards (docs/benchmarks.md, "How to run the fidelity study"):
#
#   RECIPES="bf16 fp8" DEADLINE_S=560 bash bench/fidelity_study.sh
#   python bench/fidelity_summary.py runs/a/*.jsonl runs/b/*.jsonl --png docs/fidelity_1b.png --md out.md
#
# RECIPES   recipe names or "module:function" factories (default "bf16 fp8 hybrid hybrid-original
#           nvfp4_1d_weight"); the files are named by the recipe with characters other than
#           [A-Za-z0-9._-] replaced by "_"
# CONFIG    the trainer config (default launch/configs/llama1b_1gpu.toml)
# STEPS     override train.steps (every run of a study must use the same)
# QUANTIZED_PARAMS  true (default; as bench/train_layouts.sh) or false: quantizing recipes store
#           their weights quantized (train.quantized_params); bf16 never does
# EXTRA     more trainer options, e.g. "--set train.compile=true" (words split on spaces)
# DEADLINE_S  seconds after which this call stops training (0: never): the run under way is
#           stopped with SIGTERM, its metrics so far are kept (the summary marks it incomplete),
#           later recipes are skipped, and the summary is still written before the device limit
# MIN_RUN_S  with DEADLINE_S, a recipe starts only if this many seconds are left (default 60)
# PLOT      1 (default): draw $OUT/fidelity.png when matplotlib is importable; 0: never
# PYTHON    the interpreter (default python3)
# RUN_DIR   where the trainer's out_dir goes (default /tmp/fidelity_runs; each run's final
#           checkpoint, ~13 GB at 1 B with FP32 masters, is deleted after the run)
set -uo pipefail
OUT=${OUT:-/tmp/dtq_out}
CONFIG=${CONFIG:-launch/configs/llama1b_1gpu.toml}
RECIPES=${RECIPES:-bf16 fp8 hybrid hybrid-original nvfp4_1d_weight}
STEPS=${STEPS:-}
QUANTIZED_PARAMS=${QUANTIZED_PARAMS:-true}
EXTRA=${EXTRA:-}
DEADLINE_S=${DEADLINE_S:-0}
MIN_RUN_S=${MIN_RUN_S:-60}
PLOT=${PLOT:-1}
RUN_DIR=${RUN_DIR:-/tmp/fidelity_runs}
PYTHON=${PYTHON:-python3}
source "$(dirname "$0")/device_env.sh"  # $OUT, this checkout on PYTHONPATH, carried wheels
started=$(date +%s)
left() { echo $(( DEADLINE_S - ($(date +%s) - started) )); }

if command -v nvidia-smi > /dev/null; then  # the CUDA kernels, once per machine (cached afterwards)
  if ! "$PYTHON" -m dtq.kernels build > /tmp/fidelity_kernels.log 2>&1; then
    cp /tmp/fidelity_kernels.log "$OUT/kernels.log"  # a file comes back only when the build failed
    echo "kernel build failed (see kernels.log): the runs use the reference codecs"
  fi
fi
steps=()
[[ -n "$STEPS" ]] && steps=(--steps "$STEPS")
logs=()
for recipe in $RECIPES; do
  name=${recipe//[^A-Za-z0-9._-]/_}
  limit=()
  if (( DEADLINE_S > 0 )); then
    if (( $(left) < MIN_RUN_S )); then
      echo "== $recipe: skipped, $(left) s left of DEADLINE_S=$DEADLINE_S (MIN_RUN_S=$MIN_RUN_S)" | tee -a "$OUT/$name.log"
      continue
    fi
    limit=(timeout --signal=TERM --kill-after=20 "$(left)")
  fi
  qp=false
  [[ "$recipe" != "bf16" ]] && qp=$QUANTIZED_PARAMS
  run="$RUN_DIR/$name"
  rm -rf "$run"
  start=$(date +%s)
  echo "== $recipe ($CONFIG${STEPS:+, $STEPS steps}, quantized_params=$qp)" | tee -a "$OUT/$name.log"
  # One process: the trainer sets up a one-rank process group itself (launcher "single").
  # shellcheck disable=SC2086  # EXTRA is a list of words
  "${limit[@]}" "$PYTHON" launch/train.py --config "$CONFIG" --recipe "$recipe" "${steps[@]}" \
    --set "train.quantized_params=$qp" $EXTRA --out-dir "$run" >> "$OUT/$name.log" 2>&1
  rc=$?
  (( rc == 124 || rc == 137 )) && echo "stopped at DEADLINE_S=$DEADLINE_S: the metrics so far are kept" | tee -a "$OUT/$name.log"
  echo "rc=$rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.log"
  if [[ -s "$run/metrics.jsonl" ]]; then
    cp "$run/metrics.jsonl" "$OUT/$name.jsonl"
    logs+=("$OUT/$name.jsonl")
  fi
  rm -rf "$run"
  grep -E "^step .*/[0-9]+ \||validation" "$OUT/$name.log" | tail -2
done

if (( ${#logs[@]} == 0 )); then
  echo "no run left a metrics log: nothing to summarise" >&2
  exit 1
fi
plot=()
if [[ "$PLOT" == 1 ]]; then
  if "$PYTHON" -c "import matplotlib" 2> /dev/null; then
    plot=(--png "$OUT/fidelity.png")
  else
    echo "no matplotlib here: draw the PNG where it is installed (bench/fidelity_summary.py ... --png)"
  fi
fi
"$PYTHON" "$(dirname "$0")/fidelity_summary.py" "${logs[@]}" --md "$OUT/fidelity.md" --json "$OUT/fidelity.json" "${plot[@]}"
