#!/usr/bin/env bash
# The 1.07 B decoder (launch/configs/llama1b.toml) under one parallel layout for BF16, FP8 and the
# MXFP8/NVFP4 hybrid (both with quantized parameters): issue 8's scaling runs, one device call per
# layout. Each recipe's metrics log goes to $OUT/<layout>-<recipe>.jsonl, every console line to
# $OUT/<layout>.log (4 files per call: the device tool returns at most 8).
#
#   NPROC=8 LAYOUT=fsdp  bash bench/train_layouts.sh    # FSDP2 over 8
#   NPROC=8 LAYOUT=hsdp  bash bench/train_layouts.sh    # HSDP 2 x 4
#   NPROC=8 LAYOUT=tp    bash bench/train_layouts.sh    # FSDP2 4 x TP 2
# STEPS (default 100), RECIPES (default "bf16 fp8 hybrid") and CONFIG (default the 1B one) override.
set -uo pipefail
OUT=${OUT:-/tmp/dtq_out}
NPROC=${NPROC:-8}
LAYOUT=${LAYOUT:-fsdp}
STEPS=${STEPS:-100}
RECIPES=${RECIPES:-bf16 fp8 hybrid}
CONFIG=${CONFIG:-launch/configs/llama1b.toml}
source "$(dirname "$0")/device_env.sh"  # the trainer's train extra (pydantic & co.), carried as wheels
case "$LAYOUT" in
  fsdp) extra=() ;;
  hsdp) extra=(--set parallel.replicate=2) ;;
  tp) extra=(--set parallel.tp=2) ;;
  *) echo "LAYOUT must be fsdp, hsdp or tp, not $LAYOUT" >&2; exit 2 ;;
esac
python3 -m dtq.kernels build > /dev/null 2>&1 || echo "kernel build failed: runs use the references" | tee -a "$OUT/$LAYOUT.log"
for recipe in $RECIPES; do
  qp=()
  [[ "$recipe" != "bf16" ]] && qp=(--set train.quantized_params=true)
  run="/tmp/run-$LAYOUT-$recipe"
  rm -rf "$run"
  start=$(date +%s)
  echo "== $LAYOUT $recipe (nproc $NPROC, $STEPS steps)" | tee -a "$OUT/$LAYOUT.log"
  torchrun --standalone --nproc-per-node "$NPROC" launch/train.py --config "$CONFIG" \
    --recipe "$recipe" --steps "$STEPS" "${qp[@]}" "${extra[@]}" --out-dir "$run" >> "$OUT/$LAYOUT.log" 2>&1
  echo "rc=$? after $(( $(date +%s) - start )) s" | tee -a "$OUT/$LAYOUT.log"
  cp "$run/metrics.jsonl" "$OUT/$LAYOUT-$recipe.jsonl" 2>/dev/null || true
  rm -rf "$run"  # a 1B checkpoint with FP32 masters is ~13 GB
  grep -E "^step .*/$STEPS |validation" "$OUT/$LAYOUT.log" | tail -2
done
