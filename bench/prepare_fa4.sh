#!/usr/bin/env bash
# flash-attn 4's CuTe DSL kernels, for flex_attention's BACKEND=FLASH on the device (issue 12:
# the attention figure's one option never run; `bench/flex_variants.py`'s flash_backend variant
# "does not lower (no flash-attn cute package)" on the device image). Built here, in the project
# root: the wheels (pinned, for the image's Python 3.12 and CUDA 13 torch) are ~111 MB, the CUDA
# 13 libraries' one alone 92 MB, over what one device call carries beside the tracked tree (64
# MiB in all, the ~12 MB tree included: two parts of 53 MiB did not fit), so they travel as one
# tar cut into three parts, one part per call on one warm
# machine (each call within 30 s of the last keeps /tmp):
#   calls 1 and 2, carry [".fa4-1"] then [".fa4-2"]:  bash bench/fa4_parts.sh keep
#   call 3, carry [".whl", ".fa4-3", ".bench"]: the install line, then
#     bash bench/fa4_parts.sh install && export PYTHONPATH=$(cat /tmp/fa4/pythonpath) &&
#     python3 bench/bench_attention.py --sweep --only flash_backend; python3 .bench/yardstick_attention.py
# (fa4_parts.sh install puts them into /tmp/site, the install line's PYTHONPATH, and writes
# /tmp/fa4/pythonpath: that with the directories the wheels' .pth files add, `cutlass`'s).
set -euo pipefail
PLATFORMS=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
WHEELS=(
  flash-attn-4==4.0.0b40 quack-kernels==0.6.5
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1 cuda-bindings==13.5.0 cuda-pathfinder
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.1 protobuf==6.33.1
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --pre --no-deps -d "$work/wheels" "${PLATFORMS[@]}" "${WHEELS[@]}"
tar cf "$work/fa4.tar" -C "$work/wheels" .
rm -rf .fa4-1 .fa4-2 .fa4-3
split -n 3 -d -a 1 "$work/fa4.tar" "$work/part-"
for k in 0 1 2; do
  mkdir -p ".fa4-$((k + 1))"
  mv "$work/part-$k" ".fa4-$((k + 1))/"
done
sha256sum "$work/fa4.tar" | cut -d' ' -f1 > .fa4-3/fa4.tar.sha256
du -sh .fa4-1 .fa4-2 .fa4-3
