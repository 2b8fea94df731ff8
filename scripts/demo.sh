#!/usr/bin/env bash
# The main job: set up ./.venv for the demo (no Triton or test tools on a CPU machine), then `flashdora demo`
# (PEFT DoRA vs flashdora on a small Llama-style model). A second run skips the install (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/setup.sh demo
exec "$VENV/bin/flashdora" demo "$@"
