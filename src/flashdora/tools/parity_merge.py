"""``flashdora parity --merge``: one result from runs of the same comparison on different seeds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashdora.tools.bench import record
from flashdora.tools.parity_checks import checks, summarize_training

_SAME_SETTINGS = (
    "size", "steps", "rank", "dropout", "seq", "batch", "lr", "dtype", "floor", "device", "pretrain", "pretrain_lr",
    "lora_b_ratio",
)  # fmt: skip


def merge(paths: list[str], args: argparse.Namespace) -> dict:
    """One result from several runs of the same comparison on different seeds (``--first-seed``, one device call
    each): curves in seed order, the training summary and checks over all of them. Device, versions and the logit
    check come from the first file (every run checks the same seed-0 model); each source keeps its own commit."""
    sources = []
    for path in paths:
        try:
            sources.append((Path(path), json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            raise SystemExit(f"flashdora parity --merge: cannot read {path}: {e}") from None
    first = sources[0][1]
    for path, res in sources:
        if res.get("bench") != "parity":
            raise SystemExit(f"flashdora parity --merge: {path} is not a parity result (bench {res.get('bench')!r})")
        diff = [k for k in _SAME_SETTINGS if res["settings"].get(k) != first["settings"].get(k)]
        if diff or res["device"]["name"] != first["device"]["name"]:
            raise SystemExit(f"flashdora parity --merge: {path} differs from {sources[0][0]} in {diff or ['device']}")
    curves = sorted((c for _, res in sources for c in res["curves"]), key=lambda c: c["seed"])
    seeds = [c["seed"] for c in curves]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"flashdora parity --merge: a seed appears twice: {seeds}")
    counts: dict[str, int] = {}
    for _, res in sources:
        for k, v in res["path_counts"].items():
            counts[k] = counts.get(k, 0) + v
    training = summarize_training(curves)
    check_list = checks(first["fidelity"], training, counts)
    commits = sorted({res["commit"] for _, res in sources})
    return {
        **{
            k: first[k] for k in ("bench", "device", "versions", "torch", "triton", "transformers", "peft", "protocol")
        },
        "command": getattr(args, "_argv", None) or record.command_line(),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "commit": commits[0] if len(commits) == 1 else "several: " + ", ".join(commits),
        "dirty": any(res.get("dirty") for _, res in sources),
        "timestamp": max(res["timestamp"] for _, res in sources),
        "sources": [{"file": path.name, "commit": res["commit"], "command": res["command"]} for path, res in sources],
        "settings": {**first["settings"], "seeds": len(seeds), "first_seed": min(seeds)},
        "bars": first["bars"],
        "fidelity": first["fidelity"],
        "training": training,
        "curves": curves,
        "path_counts": counts,
        "checks": check_list,
        "passed": all(c["passed"] for c in check_list),
    }
