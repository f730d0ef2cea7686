#!/usr/bin/env bash
# Bytes per token of the store's options on real features (no GPU needed: bytes are bytes):
# extract the same rows once per option and read `dflash inspect --json`. Default data: the
# first 200 rows of pystd-28m's target-written windows (.carry/gen, from `dflash generate`).
#   MODEL=.carry/pystd-28m DATA=.carry/gen ROWS=200 DEVICES=cpu bash bench/store_size.sh
#   OPTIONS="bf16-zstd1-shuffle bf16-zstd1" bash bench/store_size.sh     (a subset)
# At the Qwen3-8B width: a random target and text from `bench_extract.py --build-only` (WORK8B):
#   MODEL=WORK8B/target DATA=WORK8B/data.jsonl CONFIG=configs/qwen3-8b.yaml DTYPE=bfloat16 \
#   LAYERS=[1,9,17,25,33] LAYERS3=[1,17,33] SETS="--set packing.overlong=truncate" \
#   OPTIONS="fp8-zstd1 fp8-zstd1-3layers bf16-zstd1-3layers" bash bench/store_size.sh
# One JSON line per option on stdout (and $OUT/store-size.jsonl when OUT is set).
set -uo pipefail
MODEL=${MODEL:-.carry/pystd-28m}
DATA=${DATA:-.carry/gen}
ROWS=${ROWS:-200}
DEVICES=${DEVICES:-cpu}
WORK=${WORK:-/tmp/store-size}
LAYERS=${LAYERS:-[1,3,5,7,8]}
LAYERS3=${LAYERS3:-[2,5,8]}   # the *-3layers options
DTYPE=${DTYPE:-float32}       # target.dtype
CONFIG=${CONFIG:+--config $CONFIG}
read -ra SETS <<< "${SETS:-}"  # extra extract arguments for every option, e.g. SETS="--set k=v"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"
option() {  # $1 = name, the rest: extract --set arguments
  local name=$1; shift
  # shellcheck disable=SC2086  # CONFIG: empty or two words
  dflash extract $CONFIG --model "$MODEL" --data "$DATA" --out "$WORK/$name" --devices "$DEVICES" \
    --overwrite --set data.max_samples="$ROWS" --set target.dtype="$DTYPE" \
    --set target.tapped_layers="$LAYERS" --set run.writer_processes=0 --set run.progress=false \
    --set store.sequences_per_shard=16 --set store.hidden_dtype=bfloat16 "${SETS[@]}" "$@" \
    > "$WORK/$name.log" 2>&1 || { tail -3 "$WORK/$name.log"; return; }
  dflash inspect "$WORK/$name" --json | python3 -c "
import json, os, sys
s = json.load(sys.stdin)
head_path = '$WORK/$name/target_head.safetensors'
head = os.path.getsize(head_path) if os.path.exists(head_path) else 0
hidden = s['arrays'].get('hidden', {}).get('stored', 0) + s['arrays'].get('hidden_scale', {}).get('stored', 0)
print(json.dumps({'option': '$name', 'tokens': s['tokens'], 'bytes_per_token': round(s['bytes_per_token'], 1),
  'hidden_bytes_per_token': round(hidden / s['tokens'], 1),
  'other_bytes_per_token': round((s['array_bytes_stored'] - hidden) / s['tokens'], 1),
  'compression_ratio': round(s['compression_ratio'], 3), 'bytes_on_disk': s['bytes_on_disk'],
  # the store's copy of the LM head and embeddings: one file per store, not per token
  'head_file_bytes': head, 'bytes_per_token_without_head': round((s['bytes_on_disk'] - head) / s['tokens'], 1),
  'arrays_bytes_per_token': {k: round(a['stored'] / s['tokens'], 1) for k, a in s['arrays'].items()},
  'padding_share': round(s['padding_share'], 4), 'layers': $LAYERS}))" | tee -a "${OUT:-$WORK}/store-size.jsonl"
}
# OPTIONS: a space-separated subset of the names below (default: all)
OPTIONS=${OPTIONS:-all}
want() { [ "$OPTIONS" = all ] || [[ " $OPTIONS " == *" $1 "* ]]; }
want bf16-zstd1-shuffle && option bf16-zstd1-shuffle
want bf16-zstd1 && option bf16-zstd1 --set store.byte_shuffle=false
want bf16-zstd0 && option bf16-zstd0 --set store.compression_level=0
want bf16-zstd3-shuffle && option bf16-zstd3-shuffle --set store.compression_level=3
want bf16-zstd9 && option bf16-zstd9 --set store.compression_level=9 --set store.byte_shuffle=false
want fp8-zstd1 && option fp8-zstd1 --set store.hidden_dtype=float8_e4m3fn
want fp8-zstd3 && option fp8-zstd3 --set store.hidden_dtype=float8_e4m3fn --set store.compression_level=3
want bf16-zstd1-top8 && option bf16-zstd1-top8 --set verifier.topk=8
want bf16-zstd1-3layers && LAYERS="$LAYERS3" option bf16-zstd1-3layers
want fp8-zstd1-3layers && LAYERS="$LAYERS3" option fp8-zstd1-3layers --set store.hidden_dtype=float8_e4m3fn
want nvfp4-zstd1 && option nvfp4-zstd1 --set store.hidden_dtype=nvfp4
