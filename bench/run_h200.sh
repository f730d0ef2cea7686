#!/usr/bin/env bash
# Two device calls on one H200 (each under the 10-minute command limit) that re-measure what
# BENCHMARKS.md still lacks:
#   bash bench/run_h200.sh A   extraction at Qwen3-8B shape vs a bare forward (bf16, store
#                              kept), then a full `dflash train` step from that store on disk
#   bash bench/run_h200.sh B   the yardstick training step, then extraction with fp8 features
# Run B right after A while the machine is warm, so both halves share one machine. Each part
# has its own time limit so one slow part cannot starve the others; results go to $OUT. Start
# the device command with the wheel install line of ../shared/tools/device-wheels.sh and carry
# [".whl", ".bench"] (.bench: an ignored copy of ../shared/bench).
set -uo pipefail
PART=${1:?usage: run_h200.sh A|B}
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
case "$PART" in
  A)
    timeout 240 python3 bench/bench_extract.py --tokens 300000 --keep 2>&1 \
      | tee "$OUT/extract.log" | grep '^{'
    timeout 300 python3 bench/bench_train.py --store /tmp/bench-extract/store --steps 40 2>&1 \
      | tee "$OUT/train.log" | grep -E '^\{|Error'
    ;;
  B)
    timeout 330 python3 .bench/yardstick_train_step.py 2>&1 | tee "$OUT/yardstick_train.log" \
      | grep '^{'
    timeout 200 python3 bench/bench_extract.py --tokens 300000 --hidden-dtype float8_e4m3fn \
      2>&1 | tee "$OUT/extract_fp8.log" | grep '^{'
    ;;
  *) echo "usage: run_h200.sh A|B" >&2; exit 2 ;;
esac
