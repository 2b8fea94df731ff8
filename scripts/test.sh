#!/usr/bin/env bash
# The test suite: set up ./.venv with the test extras, then pytest (Triton kernels run in the interpreter on
# machines without CUDA). Runs against the newest supported peft and transformers (scripts/constraints.txt).
#   bash scripts/test.sh            the whole suite
#   bash scripts/test.sh --quick    the `quick` subset: every public function and the demo
# How long each takes on a CPU machine: docs/benchmarks.md, "Set-up and tests on a CPU". The tests run on
# TEST_WORKERS pytest-xdist workers (default 2; 0 runs them in this process), a test file per worker at a time.
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV EXTRAS=test-deepspeed bash scripts/setup.sh test  # DeepSpeed for tests/test_deepspeed.py (CPU, 2 ranks)
if [ "${1:-}" = --quick ]; then
  shift
  set -- -m quick "$@"
fi
exec "$VENV/bin/python" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
