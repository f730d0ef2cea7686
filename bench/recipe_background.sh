#!/usr/bin/env bash
# The pystd recipe (bench/recipe_pystd.sh) as one background job that outlives the device call,
# where the machine lets it: no process restarts between calls (each cost ~60 s of start-up and
# compiles), no per-call margins, and the stage times of one uninterrupted run. Each call
# watches the job until CALL_S seconds after the call started and returns its results so far;
# the call that sees it finish prints "recipe done". Make each call within 30 s of the last
# (a warm machine keeps /tmp only then).
#   CALL_S=570 VARIANTS="recipe|--set run.checkpoint_every=500" bash bench/recipe_background.sh
# AFTER="command" on a follow-up call runs it in that call's time left once the recipe is done.
# If the machine stopped the job between calls, the call says "job gone" and exits 3: every
# stage resumes, so go on with bench/recipe_call.sh and the same settings and $WORK. A
# follow-up call that finds a fresh machine (no job, no .carry carried) says so and exits 4.
# A call that finds the recipe still training returns the best drafter so far
# (RUN/export-best, when new) if RETURN_BEST=1, the default of follow-up calls (the call that
# starts the recipe defaults to 0); the call that finds the recipe done returns the final
# ones (RUN/export).
# The job runs from a snapshot (bench/, configs/, .carry/ and the package installed into
# $WORK/background/site), since the device replaces the working tree and the carried folders at
# each call. Settings as bench/recipe_pystd.sh (VARIANTS, GEN_SETS, EXTRACT_SETS, STORES, DEVICE, ...).
set -uo pipefail
started=$(date +%s)
CALL_S=${CALL_S:-570}
# how often a call looks at the job, in seconds (the tests look more often than a device call)
POLL_S=${POLL_S:-5}
WORK=${WORK:-/tmp/recipe}
RESULTS=${OUT:-runs/recipe}
job="$WORK/background"
mkdir -p "$job/results" "$RESULTS"
export WORK

if [ ! -f "$job/pid" ] && [ ! -d .carry ]; then
  # a follow-up call (it carries no .carry) on a machine that holds no job: a fresh machine,
  # the last call's /tmp and the run in it went with the old one (nineteenth session)
  echo "no recipe on this machine: it is a fresh one (warm: false), and the run an earlier call"
  echo "started went with the old machine's /tmp; start over with the first call's command"
  echo "(carry .carry), or spend the budget on something else"
  exit 4
fi
if [ ! -f "$job/pid" ]; then
  rm -rf "$job/src" "$job/site"
  mkdir -p "$job/src"
  cp -r bench configs .carry "$job/src/" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$job/site" . \
    > "$job/install.log" 2>&1 || { cat "$job/install.log"; exit 1; }
  (
    cd "$job/src" || exit 1
    export PATH="$job/site/bin:$PATH" PYTHONPATH="$job/site${PYTHONPATH:+:$PYTHONPATH}"
    export OUT="$job/results" TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-7200}
    # its own session: the end of the device call's shell does not signal it
    setsid nohup bash -c 'bash bench/recipe_pystd.sh; echo $? > "$1/exit"' _ "$job" \
      > "$job/recipe.log" 2>&1 < /dev/null &
    echo $! > "$job/pid"
  )
  echo "started the recipe as pid $(cat "$job/pid") (log: $job/recipe.log)"
  # its best drafter is at most a few minutes' training, and its ~44 MB would lengthen the
  # transfer before the next call, which must come within 30 s (the machine went between
  # the first two calls in the twenty-fourth session, after a call that returned one)
  RETURN_BEST=${RETURN_BEST:-0}
  # the machine's uptime when the recipe started, beside the call's held time the device tool
  # reports: whether a later plan can read the machine's start cost from inside the call
  echo "{\"uptime_s\": $(cut -d' ' -f1 /proc/uptime 2>/dev/null || echo null), \"epoch_s\": $started}" \
    > "$job/results/machine.json"
elif [ ! -f "$job/exit" ] && ! kill -0 "$(cat "$job/pid")" 2>/dev/null; then
  echo "job gone: the machine stopped pid $(cat "$job/pid") between calls; go on with"
  echo "bench/recipe_call.sh, the same settings and WORK=$WORK (every stage resumes)"
  tar czf "$RESULTS/call-$started.tgz" -C "$job" results recipe.log 2>/dev/null
  exit 3
else
  echo "watching pid $(cat "$job/pid")"
fi

# watch until the job ends or the call's time is up (the last 30 s pack the results)
while [ ! -f "$job/exit" ] && (( $(date +%s) < started + CALL_S - 30 )); do
  sleep "$POLL_S"
done
# whether the recipe has ended, read once: the AFTER hook, what is returned and the reply all
# follow this one reading (a recipe ending while the call packs is the next call's news)
finished=0
[ -f "$job/exit" ] && finished=1
tail -5 "$job/recipe.log"
# the compile warm-up trains a few steps on the GPU while generate and extract run: the first
# sign, in the first call's reply, that the training step works on this machine and torch
if grep -q "warm-up failed" "$job/results/warm-compile.log" 2>/dev/null; then
  echo "warm compile: FAILED, the training step may fail too (results/warm-compile.log)"
elif grep -q '"warm_compile_s"' "$job/results/timings.txt" 2>/dev/null; then
  echo "warm compile: done (the training step ran on this GPU)"
fi
# AFTER (a command): run once the recipe is done, in the same call, while the machine is warm
# and the GPU free (the recipe's last call ended 156 s before its CALL_S in the twenty-second
# session): a short benchmark for the slack. It writes under $OUT (its results come back in
# this call's archive, results/after/) and is cut 45 s before the call's end; it needs 60 s.
if (( finished )) && [ -n "${AFTER:-}" ] && [ ! -f "$job/after-ran" ]; then
  left=$(( started + CALL_S - 45 - $(date +%s) ))
  if (( left >= 60 )); then
    touch "$job/after-ran"
    mkdir -p "$job/results/after"
    t=$(date +%s)
    OUT="$job/results/after" timeout -k 5 "$left" bash -c "$AFTER" \
      > "$job/results/after/after.log" 2>&1
    echo "after the recipe: exit $? in $(( $(date +%s) - t )) s of $left (results/after/)"
  else
    echo "after the recipe: not run, $left s left in this call (it needs 60)"
  fi
fi
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv > "$job/results/nvidia-smi.csv" 2>&1
df -h "$WORK" > "$job/results/df.txt" 2>&1
# the host's memory and its largest processes when the call ends: the machine went between
# calls in four of the last six sessions, always with the trainer running; if a later one
# goes too, these say whether memory or disk was short when it was last seen
{ free -m; echo; ps -eo pid,rss,pcpu,etimes,args --sort=-rss | head -25 | cut -c1-200; } \
  > "$job/results/host.txt" 2>&1
if (( ! finished )); then
  # each run's training metrics so far (the recipe copies them when a run ends): a machine lost
  # mid-run still leaves its curve to read (bench/recipe_summary.py RESULTS NAME)
  for metrics in "$WORK"/run-*/metrics.jsonl; do
    run=$(basename "$(dirname "$metrics")")
    [ -f "$metrics" ] && [ "$run" != run-warm ] || continue  # (the compile warm-up's)
    cp "$metrics" "$job/results/${run#run-}-metrics.jsonl"
  done
fi
tar czf "$RESULTS/call-$started.tgz" -C "$job" results recipe.log

# return_drafters DIR: each run's RUN/DIR (an exported drafter) in parts under the device's
# 16 MiB a file (`cat run-NAME-DIR.tar.part-* | tar xf -` unpacks to run-NAME/DIR), within 56
# MiB and 7 files a call (the device returns 64 MiB and 8 files, the call's archive one of
# them: one pystd drafter is 36-44 MB, 3 parts); further ones are left there, named. One
# already returned unchanged is not sent again (its weights' and best.json's times: an
# export-best is complete once best.json is written after its files).
# export_stamp EXPORT: its weights' and best.json's modification times (what a re-export moves)
export_stamp() {
  stat -c %Y "$1/model.safetensors" "$1/best.json" 2>/dev/null | tr '\n' ' '
}
return_drafters() {
  local dir=$1 bytes_left=$(( 56 * 1024 * 1024 )) files_left=7 export run size parts stamp
  for export in "$WORK"/run-*/"$dir"; do
    [ -f "$export/model.safetensors" ] || continue
    [ "$dir" = export-best ] && [ ! -f "$export/best.json" ] && continue
    run=$(basename "$(dirname "$export")")
    stamp=$(export_stamp "$export")
    [ "$(cat "$job/returned-$run-$dir" 2>/dev/null)" = "$stamp" ] && continue
    size=$(du -sb "$export" | cut -f1)
    parts=$(( (size + 15 * 1024 * 1024 - 1) / (15 * 1024 * 1024) ))
    if (( size > bytes_left || parts > files_left )); then
      echo "$run/$dir ($size bytes) not returned: over what is left of this call's 56 MiB / 7 files"
      continue
    fi
    rm -f "$RESULTS/$run-$dir.tar.part-"*
    if ! tar cf - -C "$WORK" "$run/$dir" | split -b 15M - "$RESULTS/$run-$dir.tar.part-" \
        || [ "$(export_stamp "$export")" != "$stamp" ]; then
      # packing failed, or the trainer re-exported it meanwhile: the next call sends it
      rm -f "$RESULTS/$run-$dir.tar.part-"*
      echo "$run/$dir not returned: packing failed or it was rewritten meanwhile"
      continue
    fi
    bytes_left=$(( bytes_left - size ))
    files_left=$(( files_left - parts ))
    echo "$stamp" > "$job/returned-$run-$dir"
    echo "returned $run/$dir ($size bytes)"
  done
}
if (( finished )); then
  echo "recipe done (exit $(cat "$job/exit"))"
  # the final drafters: a figure to re-check needs no re-run
  return_drafters export
else
  # the best drafter so far: a machine lost before the next call (the nineteenth and
  # twenty-third sessions lost theirs between the second and third) still leaves a drafter to
  # evaluate on the CPU (`dflash evaluate ... --device cpu`, a minute); not from the call that
  # starts the recipe (RETURN_BEST=0 there), whose loss leaves none
  if [ "${RETURN_BEST:-1}" != 0 ]; then
    return_drafters export-best
  else
    echo "best drafter so far: not returned (RETURN_BEST=0, the default of the call that starts the recipe)"
  fi
  echo "still running: call again within 30 s"
fi
echo "call took $(( $(date +%s) - started )) s; results in $RESULTS/call-$started.tgz"
