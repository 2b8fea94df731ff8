"""When the ``FLASHDORA_*`` environment variables are read and when a bad one raises, as docs/usage.md ("Settings")
says: at the first use of a public name (or at ``import flashdora`` after PEFT), never at a bare ``import flashdora``,
and once per process. Each case runs in a fresh interpreter, as a user's process would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BAD = "FLASHDORA_BACKEND expected one of auto, triton, eager, got 'bogus'"


def _run(code: str, backend: str = "bogus") -> subprocess.CompletedProcess:
    env = {**os.environ, "FLASHDORA_BACKEND": backend, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    "code, raises",
    [
        pytest.param("import flashdora; print(flashdora.__version__)", False, id="bare-import"),
        pytest.param("import flashdora; flashdora.enable", True, id="first-public-name"),
        pytest.param("import flashdora; flashdora.configure", True, id="configure-is-a-public-name"),
        pytest.param("import peft; import flashdora", True, id="import-after-peft"),
    ],
)
def test_a_bad_value_raises_at_the_first_read_not_at_a_bare_import(code, raises):
    proc = _run(code)
    if raises:
        assert proc.returncode != 0 and f"ValueError: {BAD}" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_environment_is_read_once_per_process():
    code = (
        "import os, flashdora\n"
        "assert flashdora.configure()['backend'] == 'eager'\n"  # the first read
        "os.environ['FLASHDORA_BACKEND'] = 'bogus'\n"  # not read again: no error, no change
        "assert flashdora.configure()['backend'] == 'eager'\n"
        "print('ok')\n"
    )
    proc = _run(code, backend="eager")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_usage_md_says_when_the_values_are_read_and_raise():
    text = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    assert "flashdora reads these environment variables once per process, when its settings module" in text
    assert "A bare `import flashdora` reads nothing." in text
    assert "at `import flashdora` itself when PEFT was imported before it" in text
    assert "A bad value is a `ValueError` that names the variable, raised at that first read" in text
    assert "(at import)" not in text  # what the docs said before; the error never came at a bare import
