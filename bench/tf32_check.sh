#!/usr/bin/env bash
# TF32 matmuls for the float32 pystd target (target.matmul_precision=high) on real text, one
# GPU: generate checked as bench/generate_attn_check.sh checks a setting (identical rows of the
# first DOCS training documents, new tokens/s of each), then extract of the same generated rows
# at highest and at high (the loop's tokens/s from each log). Model and data in .carry/ (as
# bench/recipe_pystd.sh). Writes $OUT/generate-attn-check.json and $OUT/tf32-extract.jsonl.
#   OUT=$OUT DOCS=128 bash bench/tf32_check.sh
set -uo pipefail
OUT=${OUT:-runs/tf32-check}
DOCS=${DOCS:-128}
DEVICE=${DEVICE:-0}
export WORK_CHECK=${WORK_CHECK:-/tmp/tf32-check}
mkdir -p "$OUT"
M=.carry/pystd-28m
if [ ! -d "$M" ] && [ -f "$M.txz" ]; then python3 -m tarfile -e "$M.txz" .carry || exit 1; fi
KEY=target.matmul_precision A=highest B=high DOCS=$DOCS DEVICE=$DEVICE OUT=$OUT \
  bash bench/generate_attn_check.sh
echo "generate check exit $? (0: high >= 5% faster)"
for precision in highest high; do
  store="$WORK_CHECK/store-$precision"
  rm -rf "$store"
  dflash extract --config configs/pystd.yaml --model $M --data "$WORK_CHECK/highest" \
    --out "$store" --devices "$DEVICE" --set run.progress=false \
    --set target.tapped_layers=[1,4,8] --set target.matmul_precision=$precision \
    > "$WORK_CHECK/extract-$precision.log" 2>&1 || { tail -5 "$WORK_CHECK/extract-$precision.log"; exit 2; }
  # "rank 0: S shards, T tokens in X s (Y tokens/s, writes included)"
  python3 - "$WORK_CHECK/extract-$precision.log" "$precision" <<'PY' | tee -a "$OUT/tf32-extract.jsonl"
import json, re, sys
text = open(sys.argv[1]).read()
m = re.search(r"rank 0: (\d+) shards, (\d+) tokens in ([\d.]+) s \((\d+) tokens/s", text)
print(json.dumps({"matmul_precision": sys.argv[2], "shards": int(m[1]), "tokens": int(m[2]),
                  "loop_s": float(m[3]), "tokens_per_s": int(m[4])} if m else
                 {"matmul_precision": sys.argv[2], "error": "no summary line"}))
PY
done
