#!/usr/bin/env bash
# Two training variants side by side on the small real target pystd-28m, one GPU each: extract
# once over pystd train.jsonl.gz on both GPUs, then train variant 0 on GPU 0 and variant 1 on
# GPU 1 at the same time (each bounded by TRAIN_LIMIT_S), then measure each drafter's online
# acceptance against prompt lookup on the first 12 dev documents. Model and data in .carry/.
#   V0="--set optim.lr=2e-3" V1="--set optim.lr=2e-3 --set anchors.num_anchors=1024" \
#     bash bench/pystd_sweep.sh
# Figures go to $OUT (default runs/sweep): v0-train.log, v0-acceptance.json, ...
set -uo pipefail
OUT=${OUT:-runs/sweep}
WORK=${WORK:-/tmp/pystd}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
if [ ! -f "$WORK/store/zarr.json" ] || ! dflash inspect "$WORK/store" --json >/dev/null 2>&1; then
  dflash extract --model .carry/pystd-28m --data .carry/train.jsonl.gz --out "$WORK/store" \
    --devices 0,1 --set target.tapped_layers='[1,3,5,7,8]' --set store.hidden_dtype=bfloat16 --set run.progress=false \
    --set store.sequences_per_shard=32 --set data.num_proc=8 > "$OUT/extract.log" 2>&1 || {
    tail -20 "$OUT/extract.log"; exit 1; }
fi
if [ ! -f "$WORK/dev-store/zarr.json" ]; then  # the 12 online prompts' documents, 384 tokens
  dflash extract --model .carry/pystd-28m --data .carry/dev.jsonl.gz --out "$WORK/dev-store" \
    --devices 0 --set target.tapped_layers='[1,3,5,7,8]' --set store.hidden_dtype=bfloat16 --set data.max_samples=12 \
    --set packing.seq_len=384 --set packing.overlong=truncate --set run.progress=false \
    > "$OUT/dev-extract.log" 2>&1 || { tail -20 "$OUT/dev-extract.log"; exit 1; }
fi
t1=$(date +%s)
echo "extract: $((t1 - t0)) s"
variant() {  # $1 = index = GPU, the rest: train --set arguments
  local i=$1; shift
  # shellcheck disable=SC2068
  timeout "${TRAIN_LIMIT_S:-290}" dflash train --store "$WORK/store" --out "$WORK/v$i" \
    --devices "$i" --set data.holdout_sequences=64 --set run.progress=false \
    --set run.log_every=250 --set run.eval_every=1000 --set run.checkpoint_every=500 $@ \
    > "$OUT/v$i-train.log" 2>&1 || echo "v$i: train stopped at the time limit" >> "$OUT/v$i-train.log"
  [ -f "$WORK/v$i/export/model.safetensors" ] || dflash export "$WORK/v$i" >> "$OUT/v$i-train.log" 2>&1
  cp "$WORK/v$i/metrics.jsonl" "$OUT/v$i-metrics.jsonl"
  dflash evaluate --target .carry/pystd-28m --drafter "$WORK/v$i/export" \
    --data .carry/dev.jsonl.gz --no-stop-at-eos --device "cuda:$i" --json-out "$OUT/v$i-acceptance.json" \
    > "$OUT/v$i-evaluate.log" 2>&1
  dflash evaluate-offline --drafter "$WORK/v$i/export" --store "$WORK/dev-store" \
    --device "cuda:$i" --json-out "$OUT/v$i-offline-dev.json" > /dev/null 2>&1
  echo "v$i ($*): $(grep -E 'eval|stopped' "$OUT/v$i-train.log" | tail -2)"
  tail -3 "$OUT/v$i-evaluate.log"
}
# shellcheck disable=SC2086
variant 0 ${V0:-} &
# shellcheck disable=SC2086
variant 1 ${V1:-} &
wait
echo "total: $(( $(date +%s) - t0 )) s"
