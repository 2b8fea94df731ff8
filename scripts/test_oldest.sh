#!/usr/bin/env bash
# The oldest supported peft and transformers (scripts/constraints-oldest.txt): sets up ./.venv-oldest, then runs the
# tests that touch their APIs (the PEFT seam, the norm cache, the routes to it and its crash cases, autocast, Trainer,
# CLI, bench), on TEST_WORKERS pytest-xdist workers (default 2); scripts/test.sh runs the whole suite against the
# newest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-oldest CONSTRAINTS=scripts/constraints-oldest.txt bash scripts/setup.sh test
exec .venv-oldest/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@" \
  tests/test_peft_integration.py tests/ops/test_norm_cache.py tests/test_peft_autocast.py tests/test_examples.py \
  tests/test_cli.py tests/test_bench.py tests/test_bench_model.py tests/test_bench_interleave.py tests/test_report.py \
  tests/test_cache_routes.py \
  tests/test_cache_crashes.py -k "not test_random_routes"
