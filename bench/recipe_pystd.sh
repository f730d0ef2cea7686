#!/usr/bin/env bash
# The recipe end to end on the small real target pystd-28m, on one GPU, timed per stage:
#   dflash generate (the target continues windows of train.jsonl.gz) -> dflash extract ->
#   dflash train -> dflash evaluate (online tau on the 12 dev prompts vs prompt lookup) ->
#   dflash evaluate-offline on the target's own continuation of the same 12 prompts (and of
#   all 41 dev documents: `chained_dev_all_tau`, the online figure over 3.4x the prompts).
# Settings: configs/pystd.yaml. Model and data in .carry/ (pystd-28m, train.jsonl.gz,
# dev.jsonl.gz; see BENCHMARKS.md). Figures go to $OUT (default runs/recipe).
#   bash bench/recipe_pystd.sh                       the recipe as configured
#   VARIANTS="a|--set optim.lr=2e-3;b|--set optim.batch_sequences=8" bash bench/recipe_pystd.sh
#       generate and extract once, then train and evaluate the variants side by side, variant k
#       on GPU k mod the count of TRAIN_GPUS (e.g. TRAIN_GPUS=0,1; DEVICE=0,1 runs generate and
#       extract data parallel). STAGES=train,evaluate reuses $WORK's gen/ and store/.
#   FOLLOW=1 bash bench/recipe_pystd.sh              train while extract writes the store
#   STORES="f8|--set store.hidden_dtype=float8_e4m3fn" VARIANTS="NV5|;T5||f8" bash bench/recipe_pystd.sh
#       also extract the generated text into $WORK/store-f8 (EXTRACT_SETS, then its own sets),
#       after the main store; a variant's third field names the store it trains from (two
#       stores of one text side by side: the nvfp4 store (the config's, the default since the
#       forty-first session) and the fp8 store of the same features; the thirty-ninth session
#       ran it the other way round, fp8 then the default: STORES="nv|--set
#       store.hidden_dtype=nvfp4" VARIANTS="T5|;NV5||nv")
set -uo pipefail
OUT=${OUT:-runs/recipe}
WORK=${WORK:-/tmp/recipe}
CFG=${CFG:-configs/pystd.yaml}
DEVICE=${DEVICE:-0}
STAGES=${STAGES:-generate,extract,dev,train,evaluate}
TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-1500}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
M=.carry/pystd-28m
# the target travels packed (bench/prepare_carry.sh): unpacked here once
if [ ! -d "$M" ] && [ -f "$M.txz" ]; then python3 -m tarfile -e "$M.txz" .carry || exit 1; fi
# variant k trains and is evaluated on GPU k mod the count of TRAIN_GPUS (default: DEVICE)
IFS=',' read -ra TRAIN_GPUS <<< "${TRAIN_GPUS:-${DEVICE%%,*}}"
# extra --set arguments per stage (a CPU dry run shrinks everything with these)
read -ra GEN_SETS <<< "${GEN_SETS:-}"
read -ra EXTRACT_SETS <<< "${EXTRACT_SETS:-}"
# a fifth evaluation, sampled as a server at this temperature samples (empty: none): tau
# when the target draws its tokens, replies ending at their end of sequence; three seeds, as
# one moves the 12 prompts' mean by ~10% at this temperature
read -ra SAMPLED_EVAL <<< "${SAMPLED_EVAL---temperature 0.6 --top-p 0.95 --num-seeds 3}"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# a data stage whose command fails makes the script exit 1 at its end (bench/recipe_call.sh
# marks a stage done on exit 0 only)
failed=()
started=$(date +%s)
stamp() { echo "\"$1_s\": $(( $(date +%s) - $2 ))" >> "$OUT/timings.txt"; }

# the target's own continuation of the dev prompts, the offline twin of `dflash evaluate`:
# dev-store holds the 12 online prompts (the training log's figure), dev-all-store all DEV_DOCS
# documents of dev.jsonl.gz (41): the same figure over 3.4x the prompts, for comparisons. Two
# generations: generate leaves out a document whose reply is empty, so the first 12 rows of
# the larger one are not the 12 online prompts. The dev stores keep bf16 features (the store
# default is nvfp4): with them the offline figure matched the online one to 4 decimals. They take
# EXTRACT_SETS first (the tapped layers must match the training store's), then their own sets,
# among them full fp32 matmuls (the config's TF32 is for the training text): `dflash evaluate`
# verifies in fp32, and the twin should be its text. They stop at the end of text whatever the
# config says (pystd's goes past it since the 32nd session): the dev figures stay those of the
# replies a server scores (the 11, 38 of the 41), comparable with every earlier session's.
# The stage runs beside generate and extract (train waits for it): its four processes are
# almost all start-up (91 s for 6,272 new tokens, eighteenth session), time the deadline-bound
# training would otherwise lose. Its failure is a file, as a background job cannot add to
# `failed`.
DEV_DOCS=${DEV_DOCS:-41}
dev_stage() {
  local t; t=$(date +%s)
  # niced (its processes inherit it): generate's host thread, which feeds the GPU, keeps its
  # core while the warm-up's compile runs a pool of compile workers
  renice -n 10 -p "$BASHPID" > /dev/null 2>&1
  rm -f "$WORK/dev.failed"
  for dev in dev:12 dev-all:"$DEV_DOCS"; do
    name=${dev%%:*} docs=${dev#*:}
    dflash generate --config "$CFG" --model $M --data .carry/dev.jsonl.gz --out "$WORK/$name-gen" \
      --devices "${DEVICE%%,*}" --set data.max_samples="$docs" --set text.new_tokens=128 \
      --set text.stride=1000000 --set text.loss_on_prompt=false --set run.progress=false \
      --set target.matmul_precision=highest --set text.stop_at_eos=true \
      >> "$OUT/dev-generate.log" 2>&1 || touch "$WORK/dev.failed"  # {prompt, completion}
    dflash extract --config "$CFG" --model $M --data "$WORK/$name-gen" --out "$WORK/$name-store" \
      --devices "${DEVICE%%,*}" "${EXTRACT_SETS[@]}" --set packing.seq_len=384 \
      --set store.sequences_per_shard=12 \
      --set run.writer_processes=0 --set run.progress=false --set store.hidden_dtype=bfloat16 \
      --set target.matmul_precision=highest \
      >> "$OUT/dev-extract.log" 2>&1 \
      || touch "$WORK/dev.failed"
  done
  stamp dev "$t"
  if has train && [ "${WARM_COMPILE:-1}" != 0 ] && [ ! -f "$WORK/dev.failed" ]; then
    warm_compile
  fi
}
# The trainer's first step compiles (34 s in the eighteenth session) and so does its first
# dev evaluation (~15 s), inside the deadline. The same shapes compiled once beforehand, while
# generate and extract hold the GPU, leave inductor's caches (FX graphs, Triton kernels, on
# this machine's disk) to the real run: a few training steps with the first variant's
# settings on a small store of the dataset's own documents (its packing and tapped layers as
# the training store's). Best effort: a failure only costs the compile time it would have
# saved (its log: $OUT/warm-compile.log).
warm_compile() {
  local t; t=$(date +%s)
  {
    dflash extract --config "$CFG" --model $M --data .carry/train.jsonl.gz \
      --out "$WORK/warm-store" --devices "${DEVICE%%,*}" "${EXTRACT_SETS[@]}" \
      --set data.max_samples=40 --set run.progress=false \
    && dflash train --config "$CFG" --store "$WORK/warm-store" --out "$WORK/run-warm" \
      --devices "${TRAIN_GPUS[0]}" --set run.progress=false \
      --set run.eval_every=0 --set data.dev_store="$WORK/dev-store" "${WARM_SETS[@]}" \
      --set optim.max_steps=3
  } >> "$OUT/warm-compile.log" 2>&1 || echo "warm-up failed (exit $?)" >> "$OUT/warm-compile.log"
  rm -rf "$WORK/warm-store" "$WORK/run-warm"
  stamp warm_compile "$t"
}
# the first variant's train settings (the compiled shapes follow them: batch, anchors, layers)
if [ -z "${VARIANTS:-}" ]; then
  WARM_SETS=("$@")
else
  IFS='|' read -r _ first_sets _ <<< "${VARIANTS%%;*}"
  read -ra WARM_SETS <<< "$first_sets"
fi
dev_pid=
if has dev; then
  dev_stage &
  dev_pid=$!
fi
# the dev stores must be complete before training reads them (or before the script ends)
wait_dev() {
  [ -n "$dev_pid" ] || return 0
  wait "$dev_pid"
  dev_pid=
  [ -f "$WORK/dev.failed" ] && failed+=(dev)
  return 0
}

if has generate; then
  t=$(date +%s)
  dflash generate --config "$CFG" --model $M --data .carry/train.jsonl.gz --out "$WORK/gen" \
    --devices "$DEVICE" --set run.progress=false "${GEN_SETS[@]}" 2>&1 | tee "$OUT/generate.log" | tail -3 \
    || failed+=(generate)
  stamp generate "$t"
fi
# STORES="NAME|sets;NAME2|sets": further stores of the same generated text, $WORK/store-NAME,
# extracted after the main one with EXTRACT_SETS then their own sets (the tapped layers stay
# the main store's unless a store's sets say otherwise)
extra_stores=()
IFS=';' read -ra extra_stores <<< "${STORES:-}"
# extract_into SUFFIX [sets...]: the generated text into $WORK/storeSUFFIX (EXTRACT_SETS, then
# the sets), logged to extractSUFFIX.log and timed as extractSUFFIX; a failure is a file
extract_into() {
  local suffix=$1 t; shift; t=$(date +%s)
  dflash extract --config "$CFG" --model $M --data "$WORK/gen" --out "$WORK/store$suffix" \
    --devices "$DEVICE" --set run.progress=false "${EXTRACT_SETS[@]}" "$@" 2>&1 \
    | tee "$OUT/extract$suffix.log" | tail -2 || touch "$WORK/extract.failed"
  stamp "extract$suffix" "$t"
}
extract_stage() {  # a failure is a file: with FOLLOW=1 this runs as a background job
  local spec sets
  rm -f "$WORK/extract.failed"
  extract_into ""
  for spec in "${extra_stores[@]}"; do
    [ -n "$spec" ] || continue
    read -ra sets <<< "${spec#*|}"
    extract_into "-${spec%%|*}" "${sets[@]}"
  done
}
# the store's summary and what one loader worker spends per batch on this machine's cores
# (sizes data.num_workers): ~20 s of diagnostics, beside the trainer's start instead of
# before it (waited for at the end; an inspect failure fails the extract stage)
diagnostics() {
  rm -f "$WORK/inspect.failed"
  dflash inspect "$WORK/store" > "$OUT/inspect.txt" || touch "$WORK/inspect.failed"
  local spec
  for spec in "${extra_stores[@]}"; do
    [ -n "$spec" ] || continue
    dflash inspect "$WORK/store-${spec%%|*}" > "$OUT/inspect-${spec%%|*}.txt" \
      || touch "$WORK/inspect.failed"
  done
  python3 bench/loader_cost.py --store "$WORK/store" --sequences 8 16 > "$OUT/loader_cost.jsonl" 2>&1
}
# FOLLOW=1: the variants train while extract writes the store (`dflash train --follow`, the
# first epoch in shard order as shards are committed), from generate's end instead of
# extract's: extract is far from GPU-bound at pystd's size (376k tokens/s), so its ~140 s
# become training time. A trainer that catches up waits for the next shard; one whose
# extract died stops after FOLLOW_TIMEOUT_S without a shard. Every train run of a FOLLOW
# recipe follows, a resumed one too (bench/recipe_call.sh's STAGES=train: a run started
# with --follow resumes only with it).
FOLLOW_ARGS=()
if [ "${FOLLOW:-0}" = 1 ] && has train; then
  FOLLOW_ARGS=(--follow --set data.follow_timeout_s="${FOLLOW_TIMEOUT_S:-300}")
fi
extract_in_background=0
if has extract; then
  if (( ${#FOLLOW_ARGS[@]} )); then
    extract_in_background=1
    { extract_stage; diagnostics; } &
    diagnostics_pid=$!  # extract and its diagnostics, waited for at the end
  else
    extract_stage
    [ -f "$WORK/extract.failed" ] && failed+=(extract)
    diagnostics &
    diagnostics_pid=$!
  fi
fi
variant() {  # $1 = name, $2 = GPU, $3 = its store (a folder in $WORK), the rest: train --set arguments
  local name=$1 gpu=$2 store=$3; shift 3
  local eval_device; eval_device=$([ "$gpu" = cpu ] && echo cpu || echo "cuda:$gpu")
  local t; t=$(date +%s)
  if has train; then
    # (the log is appended to: bench/recipe_call.sh runs train twice in its last call, the
    # second only to export, and the first one's lines are the run's)
    # TRAIN_DEADLINE (epoch seconds): stop training then (a checkpoint every run.checkpoint_every
    # steps; rerunning with STAGES=train,... resumes), so a device call ends in its limit
    local limit=$TRAIN_LIMIT_S
    [ -n "${TRAIN_DEADLINE:-}" ] && limit=$(( TRAIN_DEADLINE - $(date +%s) ))
    # the trainer's own limit comes TRAIN_MARGIN_S earlier (its loop starts after the store
    # and model are set up, and the last evaluation, checkpoint and export follow it): it stops
    # cleanly, and a wsd schedule ends its decay there (optim.fit_time_limit) instead of the
    # signal cutting it at peak lr
    local own_limit=$(( limit - ${TRAIN_MARGIN_S:-150} ))
    (( own_limit < 60 )) && own_limit=60
    # shellcheck disable=SC2068
    timeout "$limit" dflash train --config "$CFG" --store "$WORK/$store" \
      --out "$WORK/run-$name" --devices "$gpu" --set run.progress=false \
      --set run.time_limit_s="$own_limit" --set data.dev_store="$WORK/dev-store" \
      "${FOLLOW_ARGS[@]}" $@ \
      >> "$OUT/$name-train.log" 2>&1 || echo "$name: train stopped (limit or error)" >> "$OUT/$name-train.log"
    if has evaluate && [ ! -f "$WORK/run-$name/export/model.safetensors" ]; then
      dflash export "$WORK/run-$name" >> "$OUT/$name-train.log" 2>&1
    fi
    cp "$WORK/run-$name/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
    stamp "$name-train" "$t"
  fi
  if has evaluate; then
    t=$(date +%s)
    # the evaluations at once (each is mostly start-up and a small model's decoding: 151 s
    # one after another in the eighteenth session); tokens/s in their JSON are then shared-GPU
    # figures, tau is not affected.
    # --no-stop-at-eos: the 12-prompt figure as every session measured it (the shared harness
    # decodes 128 tokens past a reply's end; dev prompt 9's reply is the end of file alone)
    # (waited for by pid: a bare `wait` would also reap the store diagnostics' job, whose own
    # wait at the end then fails with "not a child of this shell")
    local evaluations=()
    dflash evaluate --target $M --drafter "$WORK/run-$name/export" --data .carry/dev.jsonl.gz \
      --no-stop-at-eos --device "$eval_device" > "$OUT/$name-acceptance.json" 2> "$OUT/$name-evaluate.log" &
    evaluations+=($!)
    # and as `dflash evaluate` reports by default, as a server stops: each reply ends at the
    # target's end of sequence (prompt 9, whose reply is that end alone, drops out)
    dflash evaluate --target $M --drafter "$WORK/run-$name/export" --data .carry/dev.jsonl.gz \
      --device "$eval_device" > "$OUT/$name-acceptance-server.json" \
      2> "$OUT/$name-evaluate-server.log" &
    evaluations+=($!)
    if [ ${#SAMPLED_EVAL[@]} -gt 0 ]; then
      dflash evaluate --target $M --drafter "$WORK/run-$name/export" --data .carry/dev.jsonl.gz \
        --device "$eval_device" "${SAMPLED_EVAL[@]}" > "$OUT/$name-acceptance-sampled.json" \
        2> "$OUT/$name-evaluate-sampled.log" &
      evaluations+=($!)
    fi
    dflash evaluate-offline --drafter "$WORK/run-$name/export" --store "$WORK/dev-store" \
      --device "$eval_device" --json-out "$OUT/$name-offline-dev.json" > /dev/null 2>&1 &
    evaluations+=($!)
    dflash evaluate-offline --drafter "$WORK/run-$name/export" --store "$WORK/dev-all-store" \
      --device "$eval_device" --json-out "$OUT/$name-offline-dev-all.json" > /dev/null 2>&1 &
    evaluations+=($!)
    # run.export_best: the peak of the dev chained tau, when it came before the last step
    local best="$WORK/run-$name/export-best"
    if [ -f "$best/best.json" ] && ! cmp -s "$best/model.safetensors" \
        "$WORK/run-$name/export/model.safetensors"; then
      cp "$best/best.json" "$OUT/$name-best.json"
      dflash evaluate --target $M --drafter "$best" --data .carry/dev.jsonl.gz \
        --no-stop-at-eos --device "$eval_device" > "$OUT/$name-best-acceptance.json" \
        2> "$OUT/$name-best-evaluate.log" &
      evaluations+=($!)
    fi
    wait "${evaluations[@]}"
    stamp "$name-evaluate" "$t"
    python3 - "$OUT" "$name" <<'EOF'
import json, sys
out, name = sys.argv[1], sys.argv[2]
def read(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return {}
online = read(f"{out}/{name}-acceptance.json")  # {} when evaluate failed (its log says why)
server = read(f"{out}/{name}-acceptance-server.json")
sampled = read(f"{out}/{name}-acceptance-sampled.json")
offline = read(f"{out}/{name}-offline-dev.json")
offline_all = read(f"{out}/{name}-offline-dev-all.json")
try:
    best = json.load(open(f"{out}/{name}-best-acceptance.json"))["dflash"]["tau"]
    best_step = json.load(open(f"{out}/{name}-best.json"))["step"]
except (OSError, ValueError, KeyError):
    best = best_step = None  # the best export is the final one (or none)
print(json.dumps({"variant": name, "dflash_tau": online.get("dflash", {}).get("tau"),
                  "prompt_lookup_tau": online.get("prompt_lookup", {}).get("tau"),
                  "server_dflash_tau": server.get("dflash", {}).get("tau"),
                  "server_prompt_lookup_tau": server.get("prompt_lookup", {}).get("tau"),
                  "sampled_dflash_tau": sampled.get("dflash", {}).get("tau"),
                  "sampled_prompt_lookup_tau": sampled.get("prompt_lookup", {}).get("tau"),
                  "sampling": sampled.get("sampling"),
                  "chained_dev_tau": offline.get("chained_tau"),
                  "random_anchor_dev_tau": offline.get("eval_tau"),
                  "chained_dev_all_tau": offline_all.get("chained_tau"),
                  "dev_all_responses": offline_all.get("chained_responses"),
                  # prompt lookup on the same 41 responses, from the stored text alone
                  "prompt_lookup_dev_all_tau": offline_all.get("prompt_lookup_chained_tau"),
                  "best_export_tau": best, "best_export_step": best_step}))
EOF
  fi
}

wait_dev
if [ -z "${VARIANTS:-}" ]; then
  variant recipe "${TRAIN_GPUS[0]}" store "$@"
else
  IFS=';' read -ra specs <<< "$VARIANTS"
  variant_pids=()
  for k in "${!specs[@]}"; do
    # NAME|train sets[|STORE]: STORE one of STORES' names (default: the main store)
    spec=${specs[$k]} store=store
    IFS='|' read -r name sets store_name <<< "$spec"
    if [ -n "${store_name:-}" ]; then
      if [[ ";${STORES:-};" != *";$store_name|"* ]]; then
        echo "variant $name: no store $store_name in STORES=\"${STORES:-}\"" >&2
        failed+=("$name")
        continue
      fi
      store=store-$store_name
    fi
    # shellcheck disable=SC2086
    variant "$name" "${TRAIN_GPUS[$(( k % ${#TRAIN_GPUS[@]} ))]}" "$store" $sets &
    variant_pids+=($!)
  done
  # the variants by pid: a bare `wait` would also reap the diagnostics job, whose own wait
  # below then fails ("not a child of this shell")
  (( ${#variant_pids[@]} )) && wait "${variant_pids[@]}"
fi
if [ -n "${diagnostics_pid:-}" ]; then
  wait "$diagnostics_pid"
  # extract's own failure (a background job's is a file) or its inspection's, named once
  if [[ " ${failed[*]} " != *" extract "* ]] && { [ -f "$WORK/inspect.failed" ] \
      || { (( extract_in_background )) && [ -f "$WORK/extract.failed" ]; }; }; then
    failed+=(extract)
  fi
fi
# the wall time of the stages this run ran (the dev stage overlaps generate and extract)
stamp wall "$started"
sed 's/$/,/' "$OUT/timings.txt" | tr -d '\n' | sed 's/^/{/; s/,$/}\n/' > "$OUT/timings.json"
cat "$OUT/timings.json"
if (( ${#failed[@]} )); then
  echo "failed: ${failed[*]} (see their logs in $OUT)"
  exit 1
fi
