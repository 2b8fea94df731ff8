"""Benchmark result files: one JSON per run, and the Markdown table and PNG chart generated from that JSON.

Layout and keys: docs/benchmarks.md. The JSON is the record; ``render`` rebuilds the ``.md`` and ``.png`` from it,
so tables in the docs are pasted from generated files, never typed.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flashdora import config

_REPO = Path(__file__).resolve().parents[4]


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", None)
    except ImportError:
        return None


def versions() -> dict[str, str | None]:
    import flashdora

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "flashdora": flashdora.__version__,
    }


def device_info(device: torch.device | str) -> dict:
    """Name, compute capability and memory of ``device`` (a CPU gets its processor name and nulls)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 2),
            "count": torch.cuda.device_count(),
        }
    return {
        "type": device.type,
        "name": platform.processor() or platform.machine(),
        "capability": None,
        "memory_gib": None,
        "count": 1,
    }


def device_slug(info: dict) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``; any CPU -> ``cpu``."""
    if info["type"] != "cuda":
        return info["type"]
    return re.sub(r"[^a-z0-9]+", "-", info["name"].strip().lower()).strip("-") or "cuda"


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout flashdora runs from; ``FLASHDORA_COMMIT``/``FLASHDORA_DIRTY`` stand in for
    a copy without ``.git`` or with a stale one (e.g. a tree shipped to a GPU machine), and win when set.
    ``(None, None)`` without git or outside a checkout (an installed wheel, an sdist): ``_REPO`` must hold the
    ``.git``, or git would name the commit of whatever repository encloses the install (a venv inside one)."""
    if os.environ.get("FLASHDORA_COMMIT"):
        dirty = os.environ.get("FLASHDORA_DIRTY")
        return os.environ["FLASHDORA_COMMIT"], None if dirty is None else dirty not in ("0", "false", "")
    if not (_REPO / ".git").exists():
        return None, None
    try:
        commit = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(_REPO), "status", "--porcelain"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def command_line() -> list[str]:
    """This process's argv, with ``python -m flashdora.cli`` spelled out when run as a module."""
    argv0 = sys.argv[0]
    if argv0.endswith(os.path.join("flashdora", "cli.py")):
        return ["python", "-m", "flashdora.cli", *sys.argv[1:]]
    return [Path(argv0).name, *sys.argv[1:]]


def new_result(bench: str, device: torch.device | str, protocol: dict, args: dict) -> dict:
    """The header every result JSON starts with; the caller adds ``rows`` (or ``records``) and sections.

    ``command`` is the argv ``flashdora.tools.cli.main`` received (else this process's); ``args`` the parsed options.
    """
    commit, dirty = git_state()
    vers = versions()
    native = native_backward(device)
    return {
        "bench": bench,
        "command": args.get("_argv") or command_line(),
        "args": {k: v for k, v in args.items() if not k.startswith("_")},
        "commit": commit,
        "dirty": dirty,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(device),
        "versions": vers,
        # flat copies for tooling that reads them at the top level
        "torch": vers["torch"],
        "triton": vers["triton"],
        "transformers": vers["transformers"],
        "peft": vers["peft"],
        "protocol": {
            "backend_env": config.backend,
            # the CUDA caching allocator's settings move eager training steps by 20% or more (docs/benchmarks.md)
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
            "native_backward": native,
            **protocol,
        },
    }


def native_backward(device: torch.device | str) -> str:
    """Whether flashdora's training steps here take the C++ backward node (``flashdora.native``): ``on`` (the
    default), ``off`` (``FLASHDORA_NATIVE=0``), ``unbuilt`` (its build failed) or ``cpu`` (it is CUDA-only). On CUDA,
    when on, the node is built or loaded here, before any timing, so that a fresh machine's one-time build never
    lands in a row."""
    from flashdora import native

    if torch.device(device).type != "cuda":
        return "cpu"
    if not native.enabled():
        return "off"
    return "on" if native.load() is not None else "unbuilt"


def stem(result: dict) -> str:
    """``<YYYY-MM-DD>_<device-slug>_<bench>[-<tag>]`` from the result's timestamp, device, bench and ``--tag``."""
    tag = (result.get("args") or {}).get("tag")
    return f"{result['timestamp'][:10]}_{device_slug(result['device'])}_{result['bench']}" + (f"-{tag}" if tag else "")


def write(
    result: dict,
    out_dir: str | Path,
    render_md: Callable[[dict], str],
    render_png: Callable[[dict, Path], None] | None,
) -> dict[str, Path]:
    """Write ``<stem>.json``, then generate ``<stem>.md`` (and ``<stem>.png``) from the JSON as read back.

    Never overwrites a result: where ``<stem>.json`` exists (a second run the same day with the same tag), the new
    one is ``<stem>-2.json``, then ``-3``, and so on (the caller prints the paths written)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name, k = stem(result), 1
    while (out_dir / f"{name}.json").exists():
        k += 1
        name = f"{stem(result)}-{k}"
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return {"json": json_path, **render(json_path, render_md, render_png)}


def render(json_path: Path, render_md: Callable[[dict], str], render_png) -> dict[str, Path]:
    """(Re)generate the Markdown and PNG next to a result JSON."""
    result = json.loads(Path(json_path).read_text())
    result["json_name"] = Path(json_path).name  # what the Markdown links to, even after a rename
    md_path = json_path.with_suffix(".md")
    md_path.write_text(render_md(result))
    paths = {"md": md_path}
    if render_png is not None:
        png_path = json_path.with_suffix(".png")
        render_png(result, png_path)
        paths["png"] = png_path
    return paths


def interleaved(result: dict) -> bool:
    """Whether a result's modes were timed step by step (``--interleave`` of ``bench model`` and ``bench fsdp``)."""
    return result.get("protocol", {}).get("order", "").startswith("interleaved")


def paired_ratio(times_ms: Sequence[float], base_ms: Sequence[float]) -> float:
    """The median over timed steps of each step's time over the base mode's step of the same rotation (run next to
    it): an interleaved run's ratio, which the host's drifts move less than a ratio of medians."""
    return statistics.median(t / b for t, b in zip(times_ms, base_ms))


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A Markdown table; floats with two decimals, ``None`` as ``-``, ``|`` inside a cell escaped."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(v).replace("|", "\\|") for v in row) + " |" for row in rows]
    return "\n".join(lines)


def header(result: dict, title: str) -> str:
    """Title, device, versions, commit, command and protocol, as Markdown."""
    dev, v, p = result["device"], result["versions"], result["protocol"]
    mem = f", {dev['memory_gib']} GiB" if dev.get("memory_gib") else ""
    cap = f", sm {dev['capability']}" if dev.get("capability") else ""
    commit = (result["commit"] or "unknown")[:12] + (" (dirty)" if result["dirty"] else "")
    lines = [
        f"# {title}",
        "",
        f"- device: {dev['name']}{cap}{mem}",
        f"- versions: torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, transformers {v['transformers']}, "
        f"peft {v['peft']}, flashdora {v['flashdora']}, python {v['python']}",
        f"- commit: {commit}; {result['timestamp']}",
        f"- command: `{' '.join(result['command'])}`",
        "- protocol: " + ", ".join(f"{k} {val}" for k, val in p.items()),
    ]
    return "\n".join(lines)


def grouped_bars(ax, labels: Sequence[str], series: dict[str, Sequence[float | None]], ylabel: str) -> None:
    """One bar group per label, one bar per series (``None`` values are left out)."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def figure(nrows: int, ncols: int, size: tuple[float, float]):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=size, squeeze=False)


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
