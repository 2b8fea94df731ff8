#!/usr/bin/env bash
# The main job: set up ./.venv, then `flashdora demo` (PEFT DoRA vs flashdora on a small Llama-style model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/flashdora demo "$@"
