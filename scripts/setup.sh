#!/usr/bin/env bash
# Creates ./.venv with flashdora and its test tools. Keeps a torch that is already installed (e.g. a CUDA build);
# otherwise installs the CPU build torch==2.13.0, never letting pip pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"   # see the torch already installed
  else
    "$PY" -m venv "$VENV"
  fi
fi
# pip, without the local-index notices some machines print for every package ("Location ... is ignored")
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }
if ! "$VENV/bin/python" -W ignore -c "import torch" 2>/dev/null; then
  pip install "torch==2.13.0"
fi
TORCH=$("$VENV/bin/python" -W ignore -c "import torch; print(torch.__version__.split('+')[0])")
CONSTRAINTS=$(mktemp)
echo "torch==$TORCH" >"$CONSTRAINTS"
extras="test"
if ! "$VENV/bin/python" -W ignore -c "import triton" 2>/dev/null; then
  # CPU machines run the kernels in Triton's interpreter; 3.9 is the version we test with.
  "$VENV/bin/python" -W ignore -c "import torch, sys; sys.exit(torch.cuda.is_available())" && echo "triton==3.9.0" >>"$CONSTRAINTS"
  extras="test,triton"
fi
pip install -c "$CONSTRAINTS" -c scripts/constraints.txt -e ".[$extras]"
"$VENV/bin/python" -W ignore -c "import flashdora, torch; print('flashdora', flashdora.__version__, 'torch', torch.__version__)"
rm -f "$CONSTRAINTS"
