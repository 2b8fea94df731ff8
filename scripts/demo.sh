#!/usr/bin/env bash
# The main job: set up ./.venv for the demo (no Triton or test tools on a CPU machine), then `flashdora demo`
# (PEFT DoRA vs flashdora on a small Llama-style model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/flashdora demo "$@"
