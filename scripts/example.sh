#!/usr/bin/env bash
# The whole pipeline on the built-in tiny example, on the CPU, in a minute or two:
# a random-weight tiny Qwen3 target + a locally built ChatML tokenizer, the shipped example
# conversations, `dflash generate` (the target rewrites the assistant turns) -> `dflash extract`
# -> `dflash inspect` -> `dflash train` -> export -> `dflash evaluate` (tau vs prompt lookup).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORK=${WORK:-runs/example}
mkdir -p "$WORK"
# each run starts from the target: the stages resume, and refuse outputs written with other
# settings (after an upgrade that changed a default, say), which a demo should not ask about
rm -rf "$WORK/gen" "$WORK/store" "$WORK/train" "$WORK/acceptance.json" "$WORK/acceptance.png"
[ -f "$WORK/target/config.json" ] || python -m common.tiny "$WORK/target"
dflash generate --config configs/debug.yaml --model "$WORK/target" \
  --data common/example_data/conversations.jsonl --out "$WORK/gen" --devices cpu
dflash extract --config configs/debug.yaml --model "$WORK/target" \
  --data "$WORK/gen" --out "$WORK/store" --devices cpu
dflash inspect "$WORK/store"
dflash inspect verify "$WORK/store"
dflash inspect "$WORK/store" --sample 1
dflash train --config configs/debug.yaml --store "$WORK/store" --out "$WORK/train" --devices cpu
echo "drafter exported to $WORK/train/export"
# Online acceptance: tokens gained per target forward under greedy verification, DFlash vs
# prompt lookup (a random-weight target writes near-random text: expect tau near 1 for both;
# a real target and a real budget: BENCHMARKS.md)
dflash evaluate --target "$WORK/target" --drafter "$WORK/train/export" --num-prompts 8 \
  --data common/example_data/conversations.jsonl --device cpu --json-out "$WORK/acceptance.json" \
  | python3 -c "import json, sys; r = json.load(sys.stdin); print(f\"tau: DFlash {r['dflash']['tau']:.2f} vs prompt lookup {r['prompt_lookup']['tau']:.2f} (plot: $WORK/acceptance.png)\")"
