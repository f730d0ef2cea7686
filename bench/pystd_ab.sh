#!/usr/bin/env bash
# A/B of two training texts on the small real target pystd-28m, one GPU each, same trainer and
# budget: A = .carry/gen ({prompt, completion} rows from `dflash generate`: loss on the target's
# tokens only), B = .carry/gen-text (the same rows as one `text` each: loss on the prompt's
# dataset text too). Extract both (GPU 0 and 1), train each, evaluate online and chained-offline
# on the 12 dev prompts (.carry/dev-gen: the target's continuation of them). Results in $OUT.
#   bash bench/pystd_ab.sh [train --set ...]
set -uo pipefail
OUT=${OUT:-runs/ab}; WORK=${WORK:-/tmp/ab}; CFG=configs/pystd.yaml; M=.carry/pystd-28m
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DEADLINE=${DEADLINE:-$(( $(date +%s) + 3600 ))}
x() {  # bf16 features: as these rows were measured (the default became fp8 since)
  dflash extract --config "$CFG" --model $M --set run.progress=false --set store.hidden_dtype=bfloat16 "$@"
}
x --data .carry/gen --out "$WORK/store-a" --devices 0 > "$OUT/extract-a.log" 2>&1 &
x --data .carry/gen-text --out "$WORK/store-b" --devices 1 > "$OUT/extract-b.log" 2>&1 &
wait
x --data .carry/dev-gen --out "$WORK/dev-store" --devices 0 --set packing.seq_len=384 \
  --set store.sequences_per_shard=12 --set run.writer_processes=0 > "$OUT/dev-extract.log" 2>&1
echo "extracted at $(date +%s)"
arm() {  # $1 = a|b, $2 = GPU, the rest: train --set arguments
  local v=$1 gpu=$2; shift 2
  timeout $(( DEADLINE - $(date +%s) )) dflash train --config "$CFG" --store "$WORK/store-$v" \
    --out "$WORK/run-$v" --devices "$gpu" --set run.progress=false "$@" > "$OUT/$v-train.log" 2>&1 \
    || { echo "$v: stopped" >> "$OUT/$v-train.log"; dflash export "$WORK/run-$v" >> "$OUT/$v-train.log" 2>&1; }
  dflash evaluate --target $M --drafter "$WORK/run-$v/export" --data .carry/dev.jsonl.gz \
    --no-stop-at-eos --device "cuda:$gpu" > "$OUT/$v-acceptance.json" 2> "$OUT/$v-evaluate.log"
  dflash evaluate-offline --drafter "$WORK/run-$v/export" --store "$WORK/dev-store" \
    --device "cuda:$gpu" > "$OUT/$v-offline-dev.json" 2>/dev/null
  python3 -c "import json,sys; a=json.load(open('$OUT/$v-acceptance.json')); o=json.load(open('$OUT/$v-offline-dev.json')); print('$v', a['dflash']['tau'], a['prompt_lookup']['tau'], o['chained_tau'], o['eval_tau'])"
}
arm a 0 "$@" &
arm b 1 "$@" &
wait
