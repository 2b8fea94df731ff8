"""``flashdora dropout-study``: what flashdora's opt-in ``dropout="adapter"`` costs in quality, measured.

For each seed, one start (a pretrained base with the same adapters, ``parity_pretrain.start_model``) is fine-tuned
three ways on the same batches with the same dropout masks and AdamW: ``peft_dora`` (PEFT's DoRA, the exact dropout
function), ``flashdora_adapter`` (``flashdora.enable(model, dropout="adapter")``: dropout on the low-rank branch
only) and ``peft_lora`` (the same config and ``lora_A``/``lora_B`` without DoRA). At the start the three are one
function (``m = ||W + s B A||``, so ``g = 1``). Each ends with its mean loss, in eval mode, over fixed batches of
held-out text: the corpus's last 10%, which neither the pretraining nor the fine-tuning sees (``--seed`` picks them).

Writes ``<YYYY-MM-DD>_<device>_parity-dropout.{json,md,png}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from peft import get_peft_model
from peft.tuners.lora.layer import LoraLayer

import flashdora
from flashdora.peft.switch import layer_path
from flashdora.peft.variant import dropout_mode
from flashdora.tools import cli, parity, parity_pretrain
from flashdora.tools.bench import record

VARIANTS = ("peft_dora", "flashdora_adapter", "peft_lora")
LABELS = {"peft_dora": "PEFT DoRA (exact)", "flashdora_adapter": "flashdora adapter", "peft_lora": "PEFT LoRA"}
HELDOUT_FRACTION = 0.1  # the corpus's tail kept for the held-out loss
HELDOUT_SEED = 54_321  # + --seed: one fixed set of held-out batches for every seed and variant


def split_corpus(corpus: torch.Tensor, fraction: float = HELDOUT_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, heldout)``: the corpus's head and its last ``fraction`` (other files of the standard library)."""
    cut = int(len(corpus) * (1 - fraction))
    return corpus[:cut], corpus[cut:]


def variants(dora: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The three models of one start: ``dora`` itself on PEFT's path, a flashdora copy in adapter dropout mode, and
    PEFT LoRA on a copy of its base with the same config (``use_dora=False``) and the same ``lora_A``/``lora_B``."""
    config = dataclasses.replace(dora.peft_config["default"], use_dora=False)
    lora = get_peft_model(copy.deepcopy(dora).unload(), config)
    ab = {k: v for k, v in dora.state_dict().items() if ".lora_A." in k or ".lora_B." in k}
    missing = {k for k in lora.load_state_dict(ab, strict=False).missing_keys if ".lora_" in k}
    if missing or len(ab) != sum(".lora_" in k for k in lora.state_dict()):
        raise RuntimeError(f"flashdora dropout-study: LoRA adapters do not match DoRA's (missing: {sorted(missing)})")
    adapter = flashdora.enable(copy.deepcopy(dora), dropout="adapter")
    return {"peft_dora": flashdora.disable(dora), "flashdora_adapter": adapter, "peft_lora": lora}


def layer_paths(model: torch.nn.Module) -> dict[str, int]:
    """How many DoRA layers take each path with each dropout mode, as ``flashdora.report`` shows them (LoRA: none)."""
    out = Counter()
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_variant:
                path = layer_path(module, adapter)
                out[f"{path}, dropout {dropout_mode(module) if path.startswith('flashdora') else 'exact'}"] += 1
    return dict(out)


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches: list[torch.Tensor], autocast: bool) -> float:
    """Mean next-token loss of ``model`` over ``batches``, in eval mode (no dropout)."""
    model.eval()
    total = 0.0
    for batch in batches:
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
            total += model(input_ids=batch, labels=batch).loss.item()
    return total / len(batches)


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (None for one value) and the values."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "values": values}  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    """Over seeds: held-out loss per variant, and per-seed differences to ``peft_dora`` (paired: same start)."""
    final = {v: [r["heldout"][v] for r in runs] for v in VARIANTS}
    diffs = {v: spread([a - b for a, b in zip(final[v], final["peft_dora"])]) for v in VARIANTS[1:]}
    return {
        "heldout_start": spread([r["heldout_start"] for r in runs]),
        "heldout": {v: spread(final[v]) for v in VARIANTS},
        "minus_peft_dora": diffs,
        "finite": all(math.isfinite(x) for r in runs for v in VARIANTS for x in [r["heldout"][v], *r["curves"][v]]),
    }


def _settings(args: argparse.Namespace) -> dict:
    """The run's settings; rates checked here (the CLI checks the integers and the dropout)."""
    for name in ("lr", "pretrain_lr", "lora_b_ratio"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise SystemExit(f"flashdora dropout-study: --{name.replace('_', '-')} expected > 0, got {value}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    keys = ("size", "steps", "seeds", "first_seed", "pretrain", "pretrain_lr", "lora_b_ratio", "rank", "dropout",
            "seq", "batch", "lr", "heldout_batches")  # fmt: skip
    return {
        **{k: getattr(args, k) for k in keys},
        "heldout_seed": HELDOUT_SEED + args.seed,
        "dtype": "autocast" if device.type == "cuda" else "fp32",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "optimizer": "AdamW (torch defaults besides lr), adapter parameters only",
        "data": "byte ids of the standard library's .py sources; train: first 90%, held-out: last 10%",
    }


class _Progress:
    """A rich bar over all pretraining and fine-tuning steps; off a terminal, a plain line every 10%."""

    def __init__(self, console, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console, self.total, self.done, self.start = console, total, 0, time.perf_counter()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        self.bar = Progress(*columns, console=console, transient=True)
        self.task = self.bar.add_task("starting", total=total)

    def advance(self, steps: int, desc: str) -> None:
        tick = max(1, self.total // 10)
        crossed = (self.done + steps) // tick > self.done // tick
        self.done += steps
        self.bar.update(self.task, advance=steps, description=desc)
        if crossed and not self.console.is_terminal:
            elapsed = time.perf_counter() - self.start
            self.console.print(f"dropout-study: {self.done}/{self.total} steps, {elapsed:.0f} s; {desc}")


def _seed_run(s: dict, seed: int, heldout: list[torch.Tensor], progress: _Progress) -> dict:
    """One seed: pretrain, attach, train the three variants in lockstep, evaluate each on ``heldout``."""
    train, autocast, dev = split_corpus(parity.stdlib_corpus())[0], s["dtype"] == "autocast", s["device"]
    pre = parity.sample_batches(train, s["pretrain"], s["batch"], s["seq"], seed + 10_000) if s["pretrain"] else []
    dora, extra = parity_pretrain.start_model(s, seed, [b.to(dev) for b in pre])
    progress.advance(s["pretrain"], f"seed {seed}: pretrained")
    models = variants(dora)
    start = heldout_loss(models["peft_dora"], heldout, autocast)
    runs = {v: (m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=s["lr"]))
            for v, m in models.items()}  # fmt: skip
    curves = {v: [] for v in VARIANTS}
    for step, batch in enumerate(parity.sample_batches(train, s["steps"], s["batch"], s["seq"], seed)):
        for v, (model, opt) in runs.items():  # one seed per step: the same dropout masks in every variant
            curves[v].append(parity._step(model, opt, batch.to(dev), seed * 1_000_003 + step, autocast))
        progress.advance(1, f"seed {seed}: loss " + ", ".join(f"{curves[v][-1]:.3f}" for v in VARIANTS))
    return {
        "seed": seed,
        "heldout_start": start,
        "heldout": {v: heldout_loss(m, heldout, autocast) for v, m in models.items()},
        "curves": curves,
        "layers": {v: layer_paths(m) for v, m in models.items()},
        **extra,
    }


def run(args: argparse.Namespace) -> int:
    """The study; ``args`` as ``flashdora.tools.cli`` parses and checks them. Writes the result files; returns 0."""
    from rich.console import Console

    console = Console()
    s = _settings(args)
    console.print(
        f"flashdora dropout-study: Llama-style '{s['size']}', r={s['rank']}, dropout {s['dropout']}, base pretrained "
        f"{s['pretrain']} steps, {s['steps']} steps x {s['seeds']} seed(s) x {len(VARIANTS)} variants of "
        f"{s['batch']}x{s['seq']} byte tokens, lr {s['lr']}, {s['dtype']}, on {s['device']}"
    )
    heldout_text = split_corpus(parity.stdlib_corpus())[1]
    heldout = [b.to(s["device"]) for b in parity.sample_batches(heldout_text, s["heldout_batches"], s["batch"],
                                                                  s["seq"], s["heldout_seed"])]  # fmt: skip
    flashdora.reset_stats()
    seeds = range(s["first_seed"], s["first_seed"] + s["seeds"])
    started = time.perf_counter()
    progress = _Progress(console, s["seeds"] * (s["pretrain"] + s["steps"]))
    with progress.bar:
        runs = [_seed_run(s, seed, heldout, progress) for seed in seeds]
    s["wall_s"] = round(time.perf_counter() - started, 1)
    protocol = {
        "start": "one pretrained base and adapters per seed, shared by every variant (g = 1: one function)",
        "dropout_masks": "shared (one torch seed per step, every variant)",
        "heldout": f"{s['heldout_batches']} fixed batches of the corpus's last {HELDOUT_FRACTION:.0%}, eval mode",
    }
    result = {
        **record.new_result("parity-dropout", s["device"], protocol, vars(args)),
        "settings": s,
        "summary": summarize(runs),
        "runs": runs,
        "path_counts": flashdora.stats(),
    }
    paths = record.write(result, args.out, render_markdown, render_png)
    print_summary(result, console)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _pm(stat: dict, spec: str = ".4f") -> str:
    """``mean ± std`` in ``spec`` (``-`` for the std of one seed)."""
    std = "-" if stat["std"] is None else format(stat["std"], spec.lstrip("+"))
    return f"{format(stat['mean'], spec)} ± {std}"


def _rows(result: dict) -> list[list[str]]:
    """Per variant: held-out loss mean ± std, minus PEFT DoRA's (paired) mean ± std, the per-seed values."""
    summ = result["summary"]
    rows = []
    for v in VARIANTS:
        diff = summ["minus_peft_dora"].get(v)
        seeds = ", ".join(f"{x:.4f}" for x in summ["heldout"][v]["values"])
        rows.append([LABELS[v], _pm(summ["heldout"][v]), "-" if diff is None else _pm(diff, "+.2e"), seeds])
    return rows


COLUMNS = ("variant", "held-out loss (mean ± std)", "minus PEFT DoRA (mean ± std)", "per seed")


def render_markdown(result: dict) -> str:
    """The held-out table and the settings, from a result JSON."""
    s, json_name = result["settings"], result.get("json_name") or f"{record.stem(result)}.json"
    start = result["summary"]["heldout_start"]
    return "\n".join([
        record.header(result, "flashdora dropout-study"),
        "",
        f"Llama-style `{s['size']}`, base pretrained {s['pretrain']} steps, r={s['rank']}, lora_dropout "
        f"{s['dropout']}, {s['steps']} steps x {s['seeds']} seed(s) of {s['batch']}x{s['seq']} byte tokens, lr "
        f"{s['lr']}, {s['dtype']}; "
        f"held-out loss at the start (every variant): {_pm(start)}; wall time {s['wall_s']} s. "
        f"Generated from [{json_name}]({json_name}).",
        "",
        record.table(COLUMNS, _rows(result)),
        "",
        "Std: the spread over seeds (sample standard deviation); the differences are per seed (same start, batches "
        "and dropout masks), then averaged.",
    ]) + "\n"  # fmt: skip


def render_png(result: dict, path: Path) -> None:
    """Training loss per variant and seed, that loss minus PEFT DoRA's (both running means), and each seed's held-out
    loss minus PEFT DoRA's: the paired differences, as the spread between seeds dwarfs the one between variants."""
    from flashdora.tools.parity_render import _running_mean

    fig, axes = record.figure(1, 3, (16, 4.5))
    curves, deltas, heldout = axes[0]
    window = max(1, result["settings"]["steps"] // 15)
    for i, v in enumerate(VARIANTS):
        for j, r in enumerate(result["runs"]):
            label = LABELS[v] if j == 0 else None
            curves.plot(_running_mean(r["curves"][v], window), color=f"C{i}", lw=1.0, alpha=0.8, label=label)
            delta = [a - b for a, b in zip(r["curves"][v], r["curves"]["peft_dora"])]
            deltas.plot(_running_mean(delta, window), color=f"C{i}", lw=1.0, alpha=0.8, label=label)
            diff = r["heldout"][v] - r["heldout"]["peft_dora"]
            heldout.plot([i], [diff], "o", color=f"C{j}", label=f"seed {r['seed']}" if i == 0 else None)
    for ax in (deltas, heldout):
        ax.axhline(0.0, color="gray", lw=0.8)
    curves.set(xlabel="step", ylabel=f"training loss, running mean of {window}", title="fine-tuning, every seed")
    deltas.set(xlabel="step", ylabel=f"minus PEFT DoRA's, running mean of {window}", title="training loss difference")
    heldout.set_xticks(range(len(VARIANTS)), [LABELS[v] for v in VARIANTS])
    heldout.set(ylabel="held-out loss minus PEFT DoRA's", title=f"final held-out loss, {result['device']['name']}")
    for ax in axes[0]:
        ax.legend(fontsize=8)
    record.save(fig, path)


def print_summary(result: dict, console) -> None:
    from rich.table import Table

    table = Table(title="dropout-study: held-out loss after fine-tuning (same start, batches and dropout masks)")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for row in _rows(result):
        table.add_row(*row)
    console.print(table)
    layers = result["runs"][0]["layers"]
    console.print(f"layers (first seed): {layers}; call counters: {dict(sorted(result['path_counts'].items()))}")


if __name__ == "__main__":  # ``python -m flashdora.tools.parity_dropout ...`` is ``flashdora dropout-study ...``
    sys.exit(cli.main(["dropout-study", *sys.argv[1:]]))
