#!/usr/bin/env bash
# The test suite: set up ./.venv with the test extras, then pytest (Triton kernels run in the interpreter on
# machines without CUDA). Runs against the newest supported peft and transformers (scripts/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
