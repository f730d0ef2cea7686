#!/usr/bin/env bash
# Quality + multi-GPU run: the whole pipeline on the small real target pystd-28m, on every GPU
# of the machine: extract over pystd train.jsonl.gz, train the drafter, then measure online
# acceptance on the first 12 dev documents against prompt lookup. Expects the model and data
# in .carry/ (see BENCHMARKS.md). Figures go to $OUT (default runs/pystd).
#   bash bench/pipeline_pystd.sh [DEVICES] [EXTRA TRAIN --set ...]
set -euo pipefail
DEVICES=${1:-0,1}
shift || true
OUT=${OUT:-runs/pystd}
WORK=${WORK:-/tmp/pystd}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
gpu_mem() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ';'; }

t0=$(date +%s)
( while sleep 2; do echo "$(date +%s) $(gpu_mem)"; done ) > "$OUT/gpu_mem_extract.log" &
MON=$!
dflash extract --model .carry/pystd-28m --data .carry/train.jsonl.gz --out "$WORK/store" \
  --devices "$DEVICES" --set target.tapped_layers='[1,3,5,7,8]' --set store.hidden_dtype=bfloat16 --set run.progress=false \
  --set store.sequences_per_shard=32 --set data.num_proc=8 2>&1 | tee "$OUT/extract.log"
kill $MON
t1=$(date +%s)
dflash inspect "$WORK/store" --json > "$OUT/inspect.json"
[ "${VERIFY:-1}" = 1 ] && dflash inspect verify "$WORK/store" | tail -3
( while sleep 2; do echo "$(date +%s) $(gpu_mem)"; done ) > "$OUT/gpu_mem_train.log" &
MON=$!
# bounded in time: if the limit hits, the newest checkpoint is exported and evaluated
timeout "${TRAIN_LIMIT_S:-240}" dflash train --store "$WORK/store" --out "$WORK/train" \
  --devices "$DEVICES" --set data.holdout_sequences=64 --set run.progress=false \
  --set run.log_every=100 --set run.eval_every=500 --set run.checkpoint_every=250 \
  --set optim.epochs=3 "$@" 2>&1 | tee "$OUT/train.log" || echo "train stopped at the time limit"
kill $MON
[ -f "$WORK/train/export/model.safetensors" ] || dflash export "$WORK/train"
t2=$(date +%s)
cp "$WORK/train/metrics.jsonl" "$OUT/metrics.jsonl"
dflash evaluate --target .carry/pystd-28m --drafter "$WORK/train/export" --data .carry/dev.jsonl.gz \
  --no-stop-at-eos --device cuda:0 --json-out "$OUT/acceptance.json" | tail -5
# offline estimate on the same 12 dev documents (text as context, first 384 tokens each)
dflash extract --model .carry/pystd-28m --data .carry/dev.jsonl.gz --out "$WORK/dev-store" \
  --devices "${DEVICES%%,*}" --set target.tapped_layers='[1,3,5,7,8]' --set store.hidden_dtype=bfloat16 --set data.max_samples=12 \
  --set packing.seq_len=384 --set packing.overlong=truncate --set run.progress=false > "$OUT/dev-extract.log" 2>&1
dflash evaluate-offline --drafter "$WORK/train/export" --store "$WORK/dev-store" \
  --device cuda:0 --json-out "$OUT/offline-dev.json" | grep -E '"eval_tau"'
t3=$(date +%s)
echo "{\"extract_s\": $((t1 - t0)), \"train_s\": $((t2 - t1)), \"evaluate_s\": $((t3 - t2))}" | tee "$OUT/timings.json"
