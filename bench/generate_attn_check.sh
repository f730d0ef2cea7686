#!/usr/bin/env bash
# Real-text check of a generate setting before a recipe uses it: `dflash generate` of the pystd
# recipe (configs/pystd.yaml) on the first DOCS training documents, once with KEY=A and once
# with KEY=B (default: target.attn_implementation, sdpa vs ATTN, default sdpa_gqa_decode), then
# bench/generate_attn_check.py: identical rows and new tokens/s of each. Exits 0 when B is at
# least 5% faster (a recipe may then pass GEN_SETS="--set KEY=B"), 1 otherwise. Model and data
# in .carry/ (as bench/recipe_pystd.sh). Writes $OUT/generate-attn-check.json.
#   bash bench/generate_attn_check.sh && GEN_SETS="--set target.attn_implementation=sdpa_gqa_decode"
#   KEY=run.kv_cache A=dynamic B=preallocated SETS="--set target.attn_implementation=sdpa_gqa_decode" \
#     bash bench/generate_attn_check.sh && GEN_SETS="--set run.kv_cache=preallocated"
set -uo pipefail
KEY=${KEY:-target.attn_implementation}
A=${A:-sdpa}
B=${B:-${ATTN:-sdpa_gqa_decode}}
DOCS=${DOCS:-128}
DEVICE=${DEVICE:-0}
WORK=${WORK_CHECK:-/tmp/generate-attn-check}
OUT=${OUT:-runs/generate-attn-check}
mkdir -p "$OUT" "$WORK"
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for value in "$A" "$B"; do
  rm -rf "${WORK:?}/$value"
  # shellcheck disable=SC2086
  dflash generate --config configs/pystd.yaml --model .carry/pystd-28m \
    --data .carry/train.jsonl.gz --out "$WORK/$value" --devices "$DEVICE" \
    --set data.max_samples="$DOCS" --set run.progress=false ${SETS:-} --set "$KEY=$value" \
    > "$WORK/$value.log" 2>&1 || { tail -5 "$WORK/$value.log"; exit 2; }
done
python3 bench/generate_attn_check.py "$WORK/$A" "$WORK/$A.log" "$WORK/$B" "$WORK/$B.log" \
  | tee "$WORK/result.json" || exit 2
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if (r["speedup_b_over_a"] or 0) >= 1.05 else 1)' "$WORK/result.json"
