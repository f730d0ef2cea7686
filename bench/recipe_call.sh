#!/usr/bin/env bash
# One device call of the pystd recipe, for a machine whose calls end after ~10 minutes: run the
# data stages not yet done, then train until CALL_S seconds after the call started (the run
# checkpoints and the next call resumes it from $WORK, which a warm machine keeps), then, once
# training has reached its last step, evaluate. Call it again until it prints "recipe done".
#   CALL_S=570 VARIANTS="s512|--set run.checkpoint_every=250" GEN_SETS="--set text.stride=512" \
#     bash bench/recipe_call.sh
# Each stage's log and the per-stage seconds go to $OUT/call-<time>.tgz (the device returns only
# a few files per call). Settings and paths as bench/recipe_pystd.sh.
set -uo pipefail
started=$(date +%s)
CALL_S=${CALL_S:-570}
WORK=${WORK:-/tmp/recipe}
RESULTS=${OUT:-runs/recipe}
export WORK
mkdir -p "$WORK" "$RESULTS"
part="$WORK/results/call-$started"
mkdir -p "$part"

# data stages: done once (each is resumable; a finished one leaves a marker)
# (each stage resumes where a cut one stopped: it is cut 40 s before the call's end so the results
# of the call still come back)
for stage in generate extract dev; do
  [ -f "$WORK/done-$stage" ] && continue
  left=$(( started + CALL_S - 40 - $(date +%s) ))
  (( left > 30 )) || { echo "stage $stage: no time left in this call"; break; }
  OUT=$part STAGES=$stage timeout "$left" bash bench/recipe_pystd.sh && touch "$WORK/done-$stage"
  [ -f "$WORK/done-$stage" ] || { echo "stage $stage cut or failed: see $part"; break; }
done

# train until the call's deadline (the last 40 s are left for packing the results)
if [ -f "$WORK/done-dev" ] && [ ! -f "$WORK/done-train" ]; then
  deadline=$(( started + CALL_S - 40 ))
  if (( deadline - $(date +%s) > 90 )); then
    OUT=$part STAGES=train TRAIN_DEADLINE=$deadline bash bench/recipe_pystd.sh
    # every variant's last checkpoint reached its max_steps: training is complete
    if ! grep -q "stopped" "$part"/*-train.log 2>/dev/null; then touch "$WORK/done-train"; fi
  fi
fi
if [ -f "$WORK/done-train" ] && [ ! -f "$WORK/done-evaluate" ]; then
  OUT=$part STAGES=train,evaluate bash bench/recipe_pystd.sh && touch "$WORK/done-evaluate"
  echo "recipe done"
fi
df -h "$WORK" > "$part/df.txt" 2>&1
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv > "$part/nvidia-smi.csv" 2>&1
tar czf "$RESULTS/call-$started.tgz" -C "$WORK/results" "call-$started"
echo "call took $(( $(date +%s) - started )) s; results in $RESULTS/call-$started.tgz"
