#!/usr/bin/env bash
# Issue 13: the wall-clock gain of `dflash train --follow` against extract-then-train, measured in
# ONE device call of at most 9 minutes on `nvidia-h200-x2`, configs/pystd.yaml, pystd-28m:
#   sequential  `dflash extract` on GPU 0, then `dflash train` on GPU 1 (STEPS steps)
#   follow      a fresh store: `dflash extract` on GPU 0 and, started at the same moment,
#               `dflash train --follow` on GPU 1 (STEPS steps), timed to the train's end
# Both runs extract the same data (COPIES copies of .carry/train.jsonl.gz: 2 = 15.9M tokens,
# ~5,900 sequences of 3,072, ~45 GiB of store) with the same settings, and train the same STEPS
# with the same settings (TRAIN_SETS goes to both): the one difference is the overlap, and with
# it, by design of --follow, the order of epoch 0 (store order, not a shuffle; later epochs are
# the same shuffles). Each run gets its own empty datasets, inductor and Triton caches: neither
# reuses the other's tokenization or compiled kernels. The sequential store is deleted before the
# follow run (the disk holds one).
#
# What the gain can be at most: the follow train trains no faster than alone (T), and its
# streamed epoch (n0 steps, every training sequence once) cannot end before extraction commits
# the last shard (E); so follow >= max(T, E + (STEPS - n0) x step + the run's end: last
# evaluation, checkpoint, export), and gain = (E + T) / follow <= (E + T) / max(E, T): at most
# the shorter phase is hidden, i.e. at most E / (E + T) of the sequential time when E <= T
# (summary.json: follow_floor_s, gain_bound). Also in the way: train --follow waits for the
# first shard before it starts its worker (worker start-up and compile come after it), and
# looks for new shards every data.follow_poll_s (2 s, the default since the sixth session).
# Expected on two H200 (the sixth session's rates: ~31 s of extract start-up, ~240k tokens/s
# in its loop; ~30 s of train start-up and compile, 82 ms per step):
#   sequential  extract ~95 s (~5,800 sequences, ~182 shards), train ~155 s (1,500 steps):
#               ~250 s
#   follow      ~190 s: train starts ~35 s late (extract's start-up and a poll), then trains
#               at ~12 steps/s while extraction commits ~11.7 steps' worth per second, so it
#               barely waits again (~720 steps of streamed epoch, then ~780 more)
#   gain ~1.3 (bound ~1.5); the script ~7.7 minutes, within CALL_S = 510 s
#
# Device command (kind nvidia-h200-x2, carry [".whl", ".carry"], timeout_s 600):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install \
#     -q --no-index --no-deps --no-build-isolation -e . || exit 1; bash bench/follow_call.sh
# CALL_S (510 s) leaves ~90 s of the call for that install. Every phase runs under `timeout`
# (its cap, or what is left of CALL_S), and the summary is written whatever fails (a first one
# after the sequential run). Results in $OUT (2 files): summary.json (bench/follow_summary.py)
# and logs.tgz (each phase's log, both metrics.jsonl, the timelines of committed shards and
# training steps, nvidia-smi samples, both stores' root attributes). Knobs: STEPS, COPIES,
# TRAIN_SETS (extra `--set`s for both trains), SEQ_FOLLOW=1 (the sequential train with --follow
# on its finished store: epoch 0 in store order too), EXTRACT_GPU, TRAIN_GPU, CALL_S, OUT, WORK.
# SMOKE=1 checks the plumbing on a CPU: the tiny example target (common/tiny.py), the example
# conversations twice, configs/debug.yaml, both processes on the CPU, 120 steps (past the
# streamed epoch's 85), data.follow_poll_s=1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
started=$(date +%s)
SMOKE=${SMOKE:-0}
OUT=${OUT:-runs/follow}
WORK=${WORK:-/tmp/follow-bench}
LOGS=$WORK/logs
RESERVE_S=20  # left at the end for the summary and the tarball
rm -rf "$WORK"
mkdir -p "$OUT" "$LOGS" "$WORK/data" "$WORK/pids"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$SMOKE" = 1 ]; then
  CALL_S=${CALL_S:-1500}
  CFG=configs/debug.yaml
  STEPS=${STEPS:-120}
  COPIES=${COPIES:-2}
  MODEL=$WORK/tiny
  SRC=common/example_data/conversations.jsonl
  EXTRACT_DEV=cpu
  TRAIN_DEV=cpu
  TRAIN_SETS=${TRAIN_SETS:---set data.follow_poll_s=1}
  CAP_EXTRACT=300 CAP_TRAIN=400 CAP_FOLLOW=600 TICK=0.5
else
  CALL_S=${CALL_S:-510}  # of the call's 600 s: ~90 s stay for the wheel install before it
  CFG=configs/pystd.yaml
  STEPS=${STEPS:-1500}
  COPIES=${COPIES:-2}
  MODEL=.carry/pystd-28m
  SRC=.carry/train.jsonl.gz
  EXTRACT_DEV=${EXTRACT_GPU:-0}
  TRAIN_DEV=${TRAIN_GPU:-1}
  TRAIN_SETS=${TRAIN_SETS:-}
  CAP_EXTRACT=200 CAP_TRAIN=240 CAP_FOLLOW=300 TICK=1
fi
read -ra TRAIN_SET_ARGS <<< "$TRAIN_SETS"
SEQ_FLAGS=()
[ "${SEQ_FOLLOW:-0}" = 1 ] && SEQ_FLAGS=(--follow)
note() { echo "$1" >> "$LOGS/meta.txt"; echo "[follow] $1"; }
monitors=()

finish() {
  trap - EXIT INT TERM
  for pid in "${monitors[@]}"; do kill "$pid" 2> /dev/null; done
  python3 bench/follow_summary.py "$LOGS" "$OUT/summary.json" > "$LOGS/summary-stdout.txt" \
    2> "$LOGS/summary-stderr.txt" \
    || echo "{\"error\": \"bench/follow_summary.py failed: see logs.tgz\"}" > "$OUT/summary.json"
  cp "$OUT/summary.json" "$LOGS/" 2> /dev/null
  tar czf "$OUT/logs.tgz" -C "$WORK" logs
  cat "$OUT/summary.json"
  echo
  echo "[follow] took $(( $(date +%s) - started )) s; files: $(cd "$OUT" && echo *)"
}
trap finish EXIT
trap 'exit 143' INT TERM

# phase NAME CAP COMMAND...: COMMAND under `timeout` (CAP, or what is left of CALL_S), its output
# in $LOGS/NAME.log, its start, end and exit code in phases.jsonl (124/137: stopped at the limit)
phase() {
  local name=$1 cap=$2
  shift 2
  local left=$(( started + CALL_S - RESERVE_S - $(date +%s) ))
  local limit=$(( cap < left ? cap : left ))
  if (( limit < 15 )); then
    echo "{\"phase\": \"$name\", \"skipped\": true, \"left_s\": $left}" >> "$LOGS/phases.jsonl"
    echo "[follow] $name: skipped, ${left} s left of CALL_S=$CALL_S"
    return 99
  fi
  local t0 rc
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1 &
  echo $! > "$WORK/pids/$name"
  wait $!
  rc=$?
  echo "{\"phase\": \"$name\", \"start\": $t0, \"end\": $(date +%s.%N), \"rc\": $rc," \
    "\"limit_s\": $limit}" >> "$LOGS/phases.jsonl"
  echo "[follow] $name: rc $rc after $(( $(date +%s) - ${t0%.*} )) s: $(tail -n 1 "$LOGS/$name.log" | cut -c1-200)"
  return $rc
}

# sample RUN: a line per TICK in RUN-timeline.txt (time, committed shards, training steps done),
# and on GPUs nvidia-smi's utilization per second, until the run's phases are over
sample() {
  local run=$1
  (
    while :; do
      shards=$(find "$WORK/$run/store/shards" -mindepth 1 -maxdepth 1 -name 'shard-*' 2> /dev/null | wc -l)
      steps=$(cat "$WORK/$run/train/metrics.jsonl" 2> /dev/null | wc -l)
      echo "$(date +%s.%N) $shards $steps" >> "$LOGS/$run-timeline.txt"
      sleep "$TICK"
    done
  ) &
  monitors+=("$!")
  if [ "$SMOKE" != 1 ]; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader \
      -lms 1000 > "$LOGS/$run-gpu.csv" 2>&1 &
    monitors+=("$!")
  fi
}
stop_sampling() {
  for pid in "${monitors[@]}"; do kill "$pid" 2> /dev/null; done
  monitors=()
}
keep() {  # RUN: its store's root attributes and its metrics, into the logs
  cp "$WORK/$1/store/zarr.json" "$LOGS/$1-store.json" 2> /dev/null
  cp "$WORK/$1/train/metrics.jsonl" "$LOGS/$1-metrics.jsonl" 2> /dev/null
}
fresh_caches() {  # RUN: its own empty datasets, inductor and Triton caches
  export HF_DATASETS_CACHE=$WORK/$1/cache/datasets TORCHINDUCTOR_CACHE_DIR=$WORK/$1/cache/inductor
  export TRITON_CACHE_DIR=$WORK/$1/cache/triton
}

# --- prerequisites: the project importable, the GPUs, the disk, the data ---
note "smoke=$SMOKE"
note "config=$CFG"
note "steps=$STEPS"
note "train_sets=$TRAIN_SETS"
note "seq_follow=${SEQ_FOLLOW:-0}"
note "call_s=$CALL_S"
if ! python3 -c "import torch, transformers, datasets, zarr, stage1_extract.run, stage2_train.train" \
  > "$LOGS/imports.log" 2>&1; then  # also warms the page cache for both runs alike
  note "problem=the project does not import (imports.log); the device command must start with the wheel install line"
  exit 1
fi
if [ "$SMOKE" = 1 ]; then
  python3 -m common.tiny "$MODEL" > "$LOGS/tiny.log" 2>&1 || { note "problem=common.tiny failed"; exit 1; }
  ext=jsonl
else
  [ -d "$MODEL" ] && [ -f "$SRC" ] || { note "problem=$MODEL or $SRC missing: carry .carry"; exit 1; }
  ext=jsonl.gz
  nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2> /dev/null || echo 0)
  note "gpus=$gpus"
  if (( gpus < 2 )); then
    TRAIN_DEV=$EXTRACT_DEV
    note "problem=$gpus GPU(s): extract and train share GPU $EXTRACT_DEV, not the two-GPU measurement"
  fi
  # ~23 GiB of store per copy of train.jsonl.gz (3.2 KB per token); one store at a time
  avail=$(df -P -BG "$WORK" | awk 'NR == 2 { sub("G", "", $4); print $4 }')
  note "disk_avail_gib=$avail"
  if (( avail < COPIES * 24 + 5 )); then
    COPIES=$(( (avail - 5) / 24 < 1 ? 1 : (avail - 5) / 24 ))
    note "problem=only ${avail} GiB free in $WORK: COPIES lowered to $COPIES"
  fi
fi
for (( k = 0; k < COPIES; k++ )); do cp "$SRC" "$WORK/data/part-$k.$ext"; done
note "copies=$COPIES"
note "extract_devices=$EXTRACT_DEV"
note "train_devices=$TRAIN_DEV"
note "started=$started"
EXTRACT=(dflash extract --config "$CFG" --model "$MODEL" --data "$WORK/data" --devices "$EXTRACT_DEV"
  --set run.progress=false)
TRAIN=(dflash train --config "$CFG" --devices "$TRAIN_DEV" --set run.progress=false
  --set optim.max_steps="$STEPS" "${TRAIN_SET_ARGS[@]}")

# --- sequential: extract, then train ---
fresh_caches seq
sample seq
phase seq_extract "$CAP_EXTRACT" "${EXTRACT[@]}" --out "$WORK/seq/store" \
  && phase seq_train "$CAP_TRAIN" "${TRAIN[@]}" --store "$WORK/seq/store" --out "$WORK/seq/train" \
    "${SEQ_FLAGS[@]}"
stop_sampling
keep seq
rm -rf "$WORK/seq/store"  # the disk holds one store
# a first summary: what comes back if the call is cut short
python3 bench/follow_summary.py "$LOGS" "$OUT/summary.json" > /dev/null 2>&1

# --- follow: extract and train --follow started together ---
fresh_caches follow
sample follow
phase follow_extract "$CAP_FOLLOW" "${EXTRACT[@]}" --out "$WORK/follow/store" &
extract_job=$!
phase follow_train "$CAP_FOLLOW" "${TRAIN[@]}" --store "$WORK/follow/store" \
  --out "$WORK/follow/train" --follow &
train_job=$!
wait "$extract_job"
extract_rc=$?
if (( extract_rc != 0 )) && kill -0 "$train_job" 2> /dev/null && [ -f "$WORK/pids/follow_train" ]; then
  # it would wait data.follow_timeout_s for shards that never come
  note "problem=follow_extract failed (rc $extract_rc): follow_train stopped"
  kill -TERM "$(cat "$WORK/pids/follow_train")" 2> /dev/null
fi
wait "$train_job"
stop_sampling
keep follow
