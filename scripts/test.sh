#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the checks: ruff lint + format check, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check .
ruff format --check .
python -m pytest -q "$@"
