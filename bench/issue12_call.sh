#!/usr/bin/env bash
# Issue 12 (training speed) in ONE device call of at most 9 minutes, beside the yardsticks:
#   attention  .bench/yardstick_attention.py, then `bench/bench_attention.py --sweep`: flex's
#              BlockMask tiles, kernel_options, anchor orderings in compiled regions (fwd+bwd,
#              each checked against fp32; budgeted, failures recorded)
#   train      bench/profile_train_step.py: run.compile_layers false vs true and a torch.profiler
#              breakdown of ~10 steady steps, pystd shape (8 x 3,072 tokens, mixed; the loss
#              chunks compiled, the GPU default), then 8,192-token loss chunks; the Qwen3-8B
#              drafter shape eager, compiled, fp8, loss-only compiled; two pystd steps sharing
#              one GPU at once (train_pystd_pair); each step also timed with late metric reads;
#              .bench/yardstick_train_step.py (8B shape) for the ratio
#   prefetch   bench/prefetch_check.py --measure: data.prefetch_to_device checked, then timed on/off
#   generate_pystd  bench/bench_generate.py at the pystd recipe's generate shape: sdpa,
#              sdpa_gqa_decode, eager, static cache, flex_attention
# Start the device command with the wheel install line, carry [".whl", ".bench"] (and ".whl-fp8"
# for the fp8 part: bench/prepare_carry.sh puts torchao's wheel there), timeout 540:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install \
#     -q --no-index --no-deps --no-build-isolation -e . || exit 1; bash bench/issue12_call.sh
# One GPU: the parts run in the order below until CALL_S seconds (default 500) are spent; each
# has its own `timeout`, a part that no longer fits is skipped (parts.jsonl says so), and the
# results are written whatever fails. What one call leaves (on one GPU, expect the 8B parts),
# a second call runs: PARTS="train_8b yardstick_train train_8b_compiled train_8b_fp8
# train_8b_fused_loss" bash bench/..., and a third PARTS="prefetch generate_pystd" (each up
# to 300 s: they come last, and one call rarely reaches them)
# Two or more GPUs: two lanes side by side (GPU 0: attention parts, then the 8B step; GPU 1:
# the pystd step, the training yardstick, the compiled 8B step). SMOKE=1 checks the plumbing
# on a CPU (tiny shapes, forward-only sweep, no yardsticks). Results in $OUT (up to 8 files):
#   summary.txt, parts.jsonl, attention_sweep.jsonl, train_profile.jsonl, yardsticks.jsonl,
#   prefetch.jsonl, generate.jsonl, logs.tgz (every part's log, nvidia-smi, the pystd trace).
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
CALL_S=${CALL_S:-500}
PARTS=${PARTS:-}
SMOKE=${SMOKE:-0}
OUT=${OUT:-runs/issue12}
# logs stay outside $OUT until the end: a call cut short still returns only the few JSONL files
LOGS=/tmp/issue12-logs-$started
mkdir -p "$OUT" "$LOGS"
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
INSTALL='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1;'

record() {  # one line of parts.jsonl
  echo "$1" >> "$OUT/parts.jsonl"
  echo "[issue12] $1"
}

finish() {
  trap - EXIT INT TERM
  python3 bench/issue12_summary.py "$OUT" > /dev/null 2>&1 || echo "summary failed" >> "$OUT/summary.txt"
  cp "$OUT/summary.txt" "$LOGS/" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
  if (( $(stat -c %s "$OUT/logs.tgz") > 15000000 )); then  # 16 MiB per returned file
    tar czf "$OUT/logs.tgz" --exclude='trace-*' -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
  fi
  cat "$OUT/summary.txt" 2>/dev/null
  echo "[issue12] took $(( $(date +%s) - started )) s; files: $(ls "$OUT" | tr '\n' ' ')"
}
trap finish EXIT
trap 'exit 143' INT TERM

# part NAME CAP_S COMMAND...: run it under `timeout` (its cap, or what is left of CALL_S)
part() {
  local name=$1 cap=$2
  shift 2
  if [ -n "$PARTS" ] && [[ " $PARTS " != *" $name "* ]]; then return 0; fi
  local left=$(( started + CALL_S - $(date +%s) - 15 ))
  local limit=$(( cap < left ? cap : left ))
  if (( limit < 45 )); then
    record "{\"part\": \"$name\", \"status\": \"skipped\", \"reason\": \"${left} s left of CALL_S=${CALL_S}\"}"
    return 0
  fi
  local t0 rc
  t0=$(date +%s)
  PART_LIMIT=$limit timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  local timed_out=false
  if (( rc == 124 || rc == 137 )); then timed_out=true; fi
  record "{\"part\": \"$name\", \"rc\": $rc, \"timed_out\": $timed_out, \"limit_s\": $limit, \"wall_s\": $(( $(date +%s) - t0 )), \"gpu\": \"${CUDA_VISIBLE_DEVICES:-all}\"}"
  if [[ $name == yardstick* ]]; then  # its JSON lines, tagged with the part
    grep -h '^{' "$LOGS/$name.log" | sed "s/^{/{\"part\": \"$name\", /" >> "$OUT/yardsticks.jsonl"
  fi
  tail -n 3 "$LOGS/$name.log" | cut -c1-300
}

# --- prerequisites: GPU, torch/triton, the project and the wheels installed, the yardsticks ---
echo "[issue12] expects the device command to start with: $INSTALL"
nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
problems=$(SMOKE=$SMOKE python3 - <<'EOF' 2>&1
import os
problems = []
gpu = os.environ["SMOKE"] != "1"
try:
    import torch
    if gpu and not torch.cuda.is_available():
        problems.append("torch sees no CUDA GPU")
    print("torch", torch.__version__, "GPUs", torch.cuda.device_count(), flush=True)
    if not torch.__version__.startswith("2.11"):
        print("note: torch is not 2.11: the option names were checked against 2.11", flush=True)
except Exception as err:
    problems.append(f"torch: {err}")
for mod in ("triton",) * gpu + ("zarr", "stage2_train.trainstep", "common.config"):
    try:
        __import__(mod)
    except Exception as err:
        problems.append(f"import {mod}: {type(err).__name__}: {err}")
for path in (".bench/yardstick_attention.py", ".bench/yardstick_train_step.py"):
    if not os.path.isfile(path):
        problems.append(f"{path} missing: carry .bench (a copy of ../shared/bench)")
if problems:
    print("PROBLEMS: " + "; ".join(problems))
EOF
)
echo "$problems" | tee "$LOGS/check.txt"
if echo "$problems" | grep -q '^PROBLEMS'; then
  record "{\"part\": \"check\", \"rc\": 1, \"error\": $(echo "$problems" | grep '^PROBLEMS' | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')}"
  echo "[issue12] prerequisites missing; the device command must start with: $INSTALL"
  exit 1
fi
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')

# --- the parts ---
if [ "$SMOKE" = 1 ]; then
  SWEEP=(--device cpu --tiny --only order_random,prescale_qk,q64_kv64,blocks_contiguous)
  PYSTD=(--shape tiny --device cpu --warmup 1 --steps 2 --profile-steps 2)
  EIGHT_B=("${PYSTD[@]}")
  PREFETCH=(--device cpu --steps 6 --warmup 2)
  GENERATE=(--tiny --prompts 8 --new-tokens 8 --batch-size 4)
else
  SWEEP=()
  PYSTD=(--shape pystd)
  EIGHT_B=(--shape qwen3-8b)
  PREFETCH=()
  GENERATE=(--shape pystd-28m --equal-lengths --prompts 1024 --new-tokens 384 --batch-size 1024
    --dtype float32)
fi
attention_parts() {
  [ "$SMOKE" = 1 ] || part yardstick_attention 120 python3 .bench/yardstick_attention.py
  part attention_sweep 180 bash -c 'python3 bench/bench_attention.py --sweep "$@" \
    --budget-s $(( PART_LIMIT - 30 )) --variant-timeout-s 75' sweep "${SWEEP[@]}"
}
train_pystd() {
  part train_pystd 140 python3 bench/profile_train_step.py "${PYSTD[@]}" \
    --compile-layers both --trace "$LOGS/trace-pystd.json.gz"
}
train_8b() {  # the eager step (since the eighth session GPU runs compile both by default)
  part train_8b 100 python3 bench/profile_train_step.py "${EIGHT_B[@]}" --compile-layers false \
    --set loss.compile_chunks=false
}
yardstick_train() {
  [ "$SMOKE" = 1 ] || part yardstick_train 240 python3 .bench/yardstick_train_step.py
}
train_8b_compiled() {
  part train_8b_compiled 150 python3 bench/profile_train_step.py "${EIGHT_B[@]}" \
    --compile-layers true
}
# run.fp8_linear (torchao float8) at the 8B drafter shape, compiled layers (which fuse the
# casts): only when torchao imports (carry its wheel: ../shared/tools/device-wheels.sh
# torchao==0.18.0); compare with train_8b_compiled's step. FP8_RECIPE=tensorwise for one scale
# per tensor (rowwise: 141.9 vs 135.4 ms bf16 at 8B, sixteenth session: the casts cost it)
train_8b_fp8() {
  if [ -d .whl-fp8 ] && ! python3 -c 'import torchao' > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl-fp8/*.whl > /dev/null 2>&1
  fi
  if ! python3 -c 'import torchao' > /dev/null 2>&1; then
    record '{"part": "train_8b_fp8", "status": "skipped", "reason": "torchao not installed"}'
    return 0
  fi
  part train_8b_fp8 150 python3 bench/profile_train_step.py "${EIGHT_B[@]}" \
    --compile-layers true --set run.fp8_linear="${FP8_RECIPE:-rowwise}"
}
# variant PART CAP SHAPE_ARGS -- ARGS...: profile_train_step.py with ARGS, its records tagged
# "variant" in train_profile.jsonl (the summary shows it), since the shape and compile_layers
# alone would read like another part's
variant() {
  local name=$1 cap=$2 label=$3
  shift 3
  local own="$LOGS/$name"
  mkdir -p "$own"
  part "$name" "$cap" env OUT="$own" python3 bench/profile_train_step.py "$@"
  if [ -f "$own/train_profile.jsonl" ]; then
    sed "s/^{/{\"variant\": \"$label\", /" "$own/train_profile.jsonl" >> "$OUT/train_profile.jsonl"
  fi
}
# loss.compile_chunks (issue 12: the LM head's per-chunk elementwise loss math as one inductor
# region) at the 8B drafter shape, eager layers: compare its step and lm_head_loss ms with
# train_8b's
train_8b_fused_loss() {
  variant train_8b_fused_loss 150 "loss.compile_chunks=true" "${EIGHT_B[@]}" \
    --compile-layers false --set loss.compile_chunks=true
}
# fewer, larger LM-head chunks at the pystd shape (vocab 8,192: 8,192 x 8,192 fp32 logits are
# 0.27 GB): the compiled step is host-bound (busy 0.73, eighth session), and each chunk costs
# launches and guards in the forward and the backward; compare with train_pystd's compiled step
train_pystd_chunks() {
  variant train_pystd_chunks 120 "loss.head_chunk_tokens=8192" "${PYSTD[@]}" \
    --compile-layers true --set loss.head_chunk_tokens=8192 --profile-steps 5
}
# two recipe variants sharing one GPU (bench/recipe_pystd.sh with TRAIN_GPUS=0 and two VARIANTS):
# two pystd-shape compiled steps at once, each timed as train_pystd_chunks times its own solo
# step; tagged "pair-a"/"pair-b" in train_profile.jsonl. Two steps in the time of fewer than two
# solo ones is the GPU time a host-bound step leaves idle
train_pystd_pair() {
  part train_pystd_pair 150 bash -c 'for k in a b; do
      mkdir -p "$2/pair-$k"
      OUT="$2/pair-$k" python3 bench/profile_train_step.py "${@:3}" > "$2/pair-$k.log" 2>&1 &
    done; wait
    for k in a b; do
      sed "s/^{/{\"variant\": \"pair-$k\", /" "$2/pair-$k/train_profile.jsonl" >> "$1/train_profile.jsonl"
    done' pair "$OUT" "$LOGS" "${PYSTD[@]}" --compile-layers true \
    --set loss.head_chunk_tokens=8192 --profile-steps 0 --steps 30
}
# data.prefetch_to_device: first the GPU check that it trains exactly like fetching in turn,
# then the real loop at the pystd shape with it on and off ($OUT/prefetch.jsonl)
prefetch() {
  part prefetch 300 python3 bench/prefetch_check.py --measure "${PREFETCH[@]}"
}
# dflash generate's local backend at the pystd recipe's shape (fp32, one batch of 1,024 x 256
# + 384): attention implementations and the static (compiled) KV cache ($OUT/generate.jsonl)
generate_pystd() {
  part generate_pystd 300 bash -c 'for v in "--attn sdpa" "--attn sdpa_gqa_decode" \
      "--attn eager" "--cache static" "--attn flex_attention"; do
    mkdir -p "$2/gen"; OUT="$2/gen" timeout 100 python3 bench/bench_generate.py $v "${@:3}" \
      | grep "^{" >> "$1/generate.jsonl" || echo "{\"variant\": \"$v\", \"failed\": true}" >> "$1/generate.jsonl"
  done' gen "$OUT" "$LOGS" "${GENERATE[@]}"
}

if (( gpus >= 2 )); then
  ( export CUDA_VISIBLE_DEVICES=0; attention_parts; train_8b ) &
  ( export CUDA_VISIBLE_DEVICES=1; train_pystd; train_pystd_chunks; train_pystd_pair; yardstick_train
    train_8b_compiled ) &
  wait
  train_8b_fp8
  train_8b_fused_loss
  prefetch
  generate_pystd
else
  attention_parts
  train_pystd
  train_pystd_chunks
  train_pystd_pair
  train_8b
  yardstick_train
  train_8b_compiled
  train_8b_fp8
  train_8b_fused_loss
  prefetch
  generate_pystd
fi
