#!/usr/bin/env bash
# Times what a new user runs on a CPU machine and writes the log that docs/benchmarks.md ("Set-up and tests on a CPU")
# quotes: the first set-up in a new venv (a line per stage), a second scripts/demo.sh, the quick subset and the whole
# suite (scripts/test.sh), with the machine, the commit and the load average before and after.
#   bash scripts/cpu_timings.sh [LOG]   (default: benchmarks/results/<YYYY-MM-DD>_cpu_setup-and-tests.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-benchmarks/results/$(date -u +%F)_cpu_setup-and-tests.txt}
FRESH=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$FRESH")"' EXIT
TIMEFORMAT='real %3R s'
{
  echo "# Set-up, the demo, the quick subset and the whole suite on a CPU machine (scripts/cpu_timings.sh)"
  echo "device: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, no CUDA"
  echo "commit: $(git rev-parse HEAD) (uncommitted changes: $([ -z "$(git status --porcelain -- . ":(exclude)$LOG")" ] && echo no || echo yes))"
  echo "date: $(date -u +%FT%TZ)"
  echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  echo "## The first set-up, in a new venv: VENV=<new> bash scripts/setup.sh demo"
  time VENV=$FRESH bash scripts/setup.sh demo 2>&1 || echo "(failed)"
  echo
  echo "## A second scripts/demo.sh (set-up finds the venv ready), in that venv"
  time VENV=$FRESH bash scripts/demo.sh 2>&1 || echo "(failed)"
  echo
  echo "## The quick subset: bash scripts/test.sh --quick -p no:cacheprovider"
  time bash scripts/test.sh --quick -p no:cacheprovider 2>&1 | tail -3 || echo "(failed)"
  echo
  echo "## The whole suite: bash scripts/test.sh -p no:cacheprovider --durations=30"
  time bash scripts/test.sh -p no:cacheprovider --durations=30 2>&1 | sed -n '/slowest 30 durations/,$p' || echo "(failed)"
  echo
  echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
} 2>&1 | tee "$LOG"
