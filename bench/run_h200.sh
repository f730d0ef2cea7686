#!/usr/bin/env bash
# One device call on a single H200 that re-measures what BENCHMARKS.md still lacks:
#   1. extraction at Qwen3-8B shape vs a bare forward, bf16 features (store kept), then fp8;
#   2. a full `dflash train` step at Qwen3-8B size from that store on disk;
#   3. the yardstick training step beside it (from an ignored .bench/ copy of shared/bench).
# Each part has its own time limit so one slow part cannot starve the others; results go to
# $OUT/*.jsonl. Start the device command with the wheel install line of
# ../shared/tools/device-wheels.sh, carry [".whl", ".bench"], and allow ~9 minutes.
set -uo pipefail
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 python3 bench/bench_extract.py --tokens 300000 --keep 2>&1 | tee "$OUT/extract.log" | grep '^{'
timeout 200 python3 bench/bench_train.py --store /tmp/bench-extract/store --steps 40 \
  2>&1 | tee "$OUT/train.log" | grep -E '^\{|Error'
if [ -f .bench/yardstick_train_step.py ]; then
  timeout 240 python3 .bench/yardstick_train_step.py 2>&1 | tee "$OUT/yardstick_train.log" | grep '^{'
fi
timeout 120 python3 bench/bench_extract.py --tokens 300000 --hidden-dtype float8_e4m3fn \
  2>&1 | tee "$OUT/extract_fp8.log" | grep '^{'
