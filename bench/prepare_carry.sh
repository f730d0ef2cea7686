#!/usr/bin/env bash
# What a device call carries for the pystd benches, built here (run from the project root):
# .whl (zarr, datasets and their pure-Python needs), .whl-fp8 (torchao, for run.fp8_linear: only
# bench/issue12_call.sh's fp8 part needs it and installs it itself), .carry (the pystd-28m target
# as one gzip tar, the pystd train/dev data) and .bench (the shared yardsticks).
# torchao's 3.4 MB wheel lives apart because .whl + .carry + the tracked tree passed the device's
# 64 MiB carry limit with it (thirty-first session: the recipe call was refused).
# The model travels packed: unpacked it pushed the working tree past the device's 64 MiB limit
# (44 MB as gzip, 39 MB as xz, 56 MB unpacked); xz since the thirty-fourth session, when the
# tracked tree's growth (bench/results) put gzip's 44 MB over the limit too. Packing takes ~1 min
# here. bench/recipe_pystd.sh unpacks it; other scripts need it unpacked first (Python's tarfile:
# it reads xz whether or not the machine has an xz binary):
#   python3 -m tarfile -e .carry/pystd-28m.txz .carry || exit 1;
# after the install line ../shared/tools/device-wheels.sh prints. Carry [".whl", ".carry", ".bench"].
set -euo pipefail
SHARED=${SHARED:-../shared}
# zarr 3 checksums through google_crc32c; numcodecs' crc32c fallback is not needed
../shared/tools/device-wheels.sh torchao==0.18.0 > /dev/null
rm -f .whl/crc32c-*.whl
mkdir -p .whl-fp8
rm -f .whl-fp8/*.whl
mv .whl/torchao-*.whl .whl-fp8/
mkdir -p .carry .bench
chmod -R u+w .carry
rm -rf .carry/pystd-28m .carry/pystd-28m.tgz
tar cf - -C "$SHARED/models" pystd-28m | xz -9 -T2 > .carry/pystd-28m.txz
cp "$SHARED"/data/pystd/*.jsonl.gz .carry/
cp "$SHARED"/bench/*.py .bench/
du -sh .whl .whl-fp8 .carry .bench
