#!/usr/bin/env bash
# The test suite: set up ./.venv, then pytest (Triton kernels run in the interpreter on machines without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
