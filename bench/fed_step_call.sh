#!/usr/bin/env bash
# Is a 16-sequence pystd step fed by the loader? One self-contained device call (nothing kept
# in /tmp between calls): a small generated store (SOURCE_ROWS training documents continued by
# the target, stride 192, as the recipe), one loader worker's cost per batch on this machine
# (bench/loader_cost.py), then `dflash train` at 16 sequences a step for TRAIN_S seconds per
# worker count in WORKERS, with configs/pystd.yaml's loader (whole-sequence chunks); the
# summary (bench/fed_step_summary.py) gives the step time, the loader wait and sequences/s.
#   WORKERS="12 6" bash bench/fed_step_call.sh
set -uo pipefail
OUT=${OUT:-runs/fed_step}
WORK=${WORK:-/tmp/fed_step}
CFG=${CFG:-configs/pystd.yaml}
SOURCE_ROWS=${SOURCE_ROWS:-300}
DEVICE=${DEVICE:-0}
TRAIN_S=${TRAIN_S:-200}
WORKERS=${WORKERS:-12}
M=.carry/pystd-28m
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" "$WORK"
if [ ! -d "$M" ] && [ -f "$M.txz" ]; then python3 -m tarfile -e "$M.txz" .carry || exit 1; fi
t=$(date +%s)
if ! dflash inspect "$WORK/store" > /dev/null 2>&1; then
  dflash generate --config "$CFG" --model $M --data .carry/train.jsonl.gz --out "$WORK/gen" \
    --devices "$DEVICE" --set run.progress=false --set text.stride=192 \
    --set data.max_samples="$SOURCE_ROWS" > "$OUT/generate.log" 2>&1 || { tail "$OUT/generate.log"; exit 1; }
  dflash extract --config "$CFG" --model $M --data "$WORK/gen" --out "$WORK/store" \
    --devices "$DEVICE" --set run.progress=false > "$OUT/extract.log" 2>&1 || { tail "$OUT/extract.log"; exit 1; }
fi
echo "store ready in $(( $(date +%s) - t )) s"
python3 bench/loader_cost.py --store "$WORK/store" --sequences 16 > "$OUT/loader_cost.jsonl" 2>&1
cat "$OUT/loader_cost.jsonl"
for w in $WORKERS; do
  rm -rf "$WORK/run-w$w"
  timeout -k 10 "$TRAIN_S" dflash train --config "$CFG" --store "$WORK/store" \
    --out "$WORK/run-w$w" --devices "$DEVICE" --set run.progress=false \
    --set optim.batch_sequences=16 --set optim.lr=2e-3 --set optim.max_steps=100000 \
    --set data.prefetch_to_device=true --set data.num_workers="$w" \
    > "$OUT/train-w$w.log" 2>&1
  cp "$WORK/run-w$w/metrics.jsonl" "$OUT/metrics-w$w.jsonl" 2>/dev/null
  python3 bench/fed_step_summary.py --workers "$w" "$OUT/metrics-w$w.jsonl" | tee -a "$OUT/summary.jsonl"
done
