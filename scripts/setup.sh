#!/usr/bin/env bash
# Creates ./.venv with flashdora and what one job needs:
#   setup.sh demo   `flashdora demo`: flashdora[cli]; no Triton on a machine without CUDA (the demo runs eager there)
#   setup.sh test   the suite: flashdora[test], and Triton (its interpreter runs the kernels on CPU)
# Keeps a torch that is already installed (e.g. a CUDA build); otherwise installs the CPU build torch==2.13.0, never
# letting pip pull a CUDA torch. peft and transformers are pinned by scripts/constraints.txt (the newest supported);
# VENV=.venv-oldest CONSTRAINTS=scripts/constraints-oldest.txt builds one with the oldest (scripts/test_oldest.sh).
# A second run with nothing changed skips pip (a stamp in the venv; see below) and takes a few seconds. Each stage it
# runs prints one line, with the time it took: creating .venv, installing torch (CPU), installing flashdora.
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:-test}
case "$JOB" in
  demo) extras="cli" ;;
  test) extras="test" ;;
  *) echo "usage: scripts/setup.sh [demo|test]" >&2; exit 2 ;;
esac
# EXTRAS: more of pyproject.toml's extras, comma-separated (scripts/test.sh: test-deepspeed); stamped apart (below)
extras="$extras${EXTRAS:+,$EXTRAS}"
NAME=$JOB${EXTRAS:++$EXTRAS}
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
PINS=${CONSTRAINTS:-scripts/constraints.txt}
stage() {  # stage WHAT COMMAND...: runs COMMAND on one line "setup.sh: WHAT ... done in N s"
  local what=$1 start
  shift
  start=$(date +%s%N)
  printf 'setup.sh: %s ... ' "$what"
  "$@"
  printf 'done in %s s\n' "$(awk -v ns=$(($(date +%s%N) - start)) 'BEGIN { printf "%.1f", ns / 1e9 }')"
}
if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    stage "creating $VENV (seeing the torch already installed)" "$PY" -m venv --system-site-packages "$VENV"
  else
    stage "creating $VENV" "$PY" -m venv "$VENV"
  fi
fi
# A stamp per job records what the last successful install was made from: this checkout's path, pyproject.toml, the
# pins, and the torch and Triton installed. When it matches, the venv already satisfies them and pip is skipped (the
# install is editable: source changes need none). A `test` venv also serves the demo (its extras include `cli`).
stamp_key() {
  { pwd; cat pyproject.toml "$PINS"
    "$VENV/bin/python" -c "import importlib.metadata as m, sys
for name in ('torch', 'triton'):
    try: print(name, m.version(name))
    except m.PackageNotFoundError: print(name, None)
print(sys.version)"
  } | sha256sum | cut -d' ' -f1
}
STAMP="$VENV/.flashdora-setup"
ready() {  # the stamp of $1 matches and flashdora imports from this checkout
  [ -f "$STAMP.$1" ] && [ "$(cat "$STAMP.$1")" = "$(stamp_key)" ] &&
    "$VENV/bin/python" -W ignore -c "import flashdora, os, sys; here = os.path.realpath(sys.argv[1]) + os.sep
sys.exit(not os.path.realpath(flashdora.__file__).startswith(here))" "$PWD" 2>/dev/null
}
if ready "$NAME" || { [ "$JOB" = demo ] && ready test; }; then
  echo "setup.sh: $VENV already has what '$JOB' needs (pyproject.toml, $PINS and torch unchanged); pip skipped"
  exit 0
fi
rm -f "$STAMP.$JOB" "$STAMP.$NAME"
# pip, without the local-index notices some machines print for every package ("Location ... is ignored")
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }
if ! "$VENV/bin/python" -W ignore -c "import torch" 2>/dev/null; then
  stage "installing torch (CPU)" pip install "torch==2.13.0"
fi
TORCH=$("$VENV/bin/python" -W ignore -c "import torch; print(torch.__version__.split('+')[0])")
CONSTRAINTS_FILE=$(mktemp)
trap 'rm -f "$CONSTRAINTS_FILE"' EXIT
echo "torch==$TORCH" >"$CONSTRAINTS_FILE"
if ! "$VENV/bin/python" -W ignore -c "import triton" 2>/dev/null; then
  # CUDA torch wheels bring their own Triton; this is for CPU machines and torch builds without it.
  if "$VENV/bin/python" -W ignore -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then
    # No CUDA: only the tests need Triton (its interpreter); 3.9 is the version we test with.
    if [ "$JOB" = test ]; then
      echo "triton==3.9.0" >>"$CONSTRAINTS_FILE"
      extras="$extras,triton"
    fi
  else
    extras="$extras,triton"
  fi
fi
stage "installing flashdora[$extras] (peft, transformers and the rest)" \
  pip install -c "$CONSTRAINTS_FILE" -c "$PINS" -e ".[$extras]"
"$VENV/bin/python" -W ignore -c \
  "import flashdora, torch; print('flashdora', flashdora.__version__, 'torch', torch.__version__)"
stamp_key >"$STAMP.$JOB"
stamp_key >"$STAMP.$NAME"  # (with EXTRAS: the job's own stamp too, as it has what the job needs)
