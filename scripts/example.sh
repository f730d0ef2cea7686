#!/usr/bin/env bash
# The whole pipeline on the built-in tiny example, on the CPU, in a minute or two:
# a random-weight tiny Qwen3 target + a locally built ChatML tokenizer, the shipped example
# conversations, `dflash extract` -> `dflash inspect` -> `dflash train` -> export.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORK=${WORK:-runs/example}
mkdir -p "$WORK"
[ -f "$WORK/target/config.json" ] || python -m common.tiny "$WORK/target"
dflash extract --config configs/debug.yaml --model "$WORK/target" \
  --data common/example_data/conversations.jsonl --out "$WORK/store" --devices cpu
dflash inspect "$WORK/store"
dflash inspect verify "$WORK/store"
dflash inspect "$WORK/store" --sample 1
dflash train --config configs/debug.yaml --store "$WORK/store" --out "$WORK/train" --devices cpu
echo "drafter exported to $WORK/train/export"
