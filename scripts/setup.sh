#!/usr/bin/env bash
# Create .venv (once) and install dflash-offline into it with its test tools.
# On a machine without an NVIDIA GPU, torch is the CPU build 2.13.0; with a GPU, pip's default.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q torch==2.13.0
  fi
fi
python -m pip install -q -e '.[test]'
