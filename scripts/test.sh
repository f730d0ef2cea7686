#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the checks: ruff lint + format check, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check .
ruff format --check .
# two pytest-xdist workers by default (CI's machine has two cores: 7 vs 12 minutes of tests);
# PYTEST_WORKERS=0, or -n 0 among the arguments (the last -n wins), runs them in this process,
# as --pdb needs
python -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@"
