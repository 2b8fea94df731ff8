"""Installing without a checkout (README, "Install"): the wheel that ``pip wheel --no-deps -w dist .`` builds installs
into a fresh venv and runs ``flashdora demo`` from a folder outside the clone, importing flashdora from the venv.

No network here: the build uses this venv's setuptools (``--no-build-isolation``), and the new venv takes torch, peft,
transformers and rich from this venv's site-packages (a ``.pth`` line) instead of downloading them.
"""

import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_the_readme_documents_both_ways_to_install_without_a_checkout():
    readme = (ROOT / "README.md").read_text()
    assert 'pip install "flashdora[cli] @ git+<repository URL>"' in readme
    assert "pip wheel --no-deps -w dist ." in readme and "dist/flashdora-0.1.0-py3-none-any.whl[cli]" in readme


def test_the_wheel_installs_and_runs_the_demo_outside_the_clone(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)])
    wheels = list(dist.glob("flashdora-*.whl"))
    assert [w.name for w in wheels] == ["flashdora-0.1.0-py3-none-any.whl"]  # the name the README gives

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    ours = [sysconfig.get_path("purelib"), *site.getsitepackages()]
    (purelib / "from_test_venv.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")  # torch, peft, rich...
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    _run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheels[0])])

    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    where = _run([str(python), "-c", "import flashdora; print(flashdora.__file__)"], cwd=away, env=env).stdout
    assert Path(where.strip()).is_relative_to(venv), f"flashdora came from {where.strip()}, not the new venv"

    argv = ["demo", "--size", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--rank", "4"]
    out = " ".join(_run([str(venv / "bin" / "flashdora"), *argv], cwd=away, env=env).stdout.split())
    assert "PEFT DoRA" in out and "flashdora (eager)" in out
    assert float(re.search(r"max \|delta loss\| over 2 steps: (\S+)", out).group(1)) < 1e-5
    assert not any(away.iterdir()), "the demo wrote into the folder it ran from"
