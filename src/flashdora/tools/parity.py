"""``flashdora parity``: is a flashdora model the same model as PEFT's DoRA? Logits and training curves.

1. Logit fidelity: final logits of flashdora vs PEFT DoRA on the same weights and inputs, in fp32 and under bf16
   autocast, and of both vs the same model run by PEFT in float64 (the judge).
2. Training curves: the same model, text, seeds, dropout masks and AdamW, trained with PEFT DoRA and with flashdora
   in lockstep; mean and max per-step |loss delta|. The text is the standard library's own source, as bytes.

Writes ``<YYYY-MM-DD>_<device>_parity.{json,md,png}`` under ``--out``; exits 1 when a bar fails unless ``--no-check``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

import flashdora
from flashdora.tools import cli, demo, parity_pretrain
from flashdora.tools.bench import record
from flashdora.tools.parity_checks import COSINE_BAR, F64_FACTOR, F64_SLACK, checks, summarize_training
from flashdora.tools.parity_merge import merge
from flashdora.tools.parity_render import LOSS_BAR, print_summary, render_markdown, render_png

MODES = ("fp32", "autocast")
MAGNITUDE_SPREAD = 0.05  # relative spread put on m before the logit check (see spread_magnitudes)


@functools.lru_cache(maxsize=2)
def stdlib_corpus(max_bytes: int = 16 * 2**20) -> torch.Tensor:
    """The standard library's ``.py`` files (sorted walk, no site-/dist-packages) as ``[n]`` uint8 byte ids."""
    root = sysconfig.get_paths()["stdlib"]
    data, size = [], 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            data.append(Path(folder, name).read_bytes())
            size += len(data[-1])
            if size >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(data)[:max_bytes]), dtype=torch.uint8)
    if size == 0:
        raise RuntimeError(f"flashdora parity: no .py files under the standard library path {root}")
    return torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)


def sample_batches(corpus: torch.Tensor, count: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``count`` batches of ``[batch, seq]`` token ids (int64), windows of ``corpus`` at seeded random offsets."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(corpus) - seq, (count, batch, 1), generator=gen)
    return list(corpus[starts + torch.arange(seq)].long())


def spread_magnitudes(model: torch.nn.Module, seed: int, spread: float = MAGNITUDE_SPREAD) -> None:
    """Scale each DoRA magnitude by ``1 + spread * N(0, 1)``: PEFT starts at ``m = ||W + s B A||`` (g = 1), where
    the ``(g - 1)`` terms vanish and their errors hide; training moves m off the norm."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_((1 + spread * torch.randn(p.shape, generator=gen)).to(p))


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Cosine, ``max|out - ref| / max|ref|`` and ``||out - ref|| / ||ref||``, in float64."""
    out, ref = out.double().flatten(), ref.double().flatten()
    diff = out - ref
    return {
        "cosine": (out @ ref / (out.norm() * ref.norm()).clamp_min(1e-300)).item(),
        "max_rel_err": (diff.abs().max() / ref.abs().max().clamp_min(1e-300)).item(),
        "rel_err": (diff.norm() / ref.norm().clamp_min(1e-300)).item(),
    }


def _logits(model, input_ids: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.no_grad(), torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=input_ids).logits.double()


def logit_fidelity(model, input_ids: torch.Tensor, modes=MODES) -> dict[str, dict[str, dict[str, float]]]:
    """Final logits of ``model`` (a PEFT DoRA model, fp32) with flashdora, with PEFT, and with PEFT in float64.

    Returns ``{mode: {"flash_vs_peft" | "flash_vs_f64" | "peft_vs_f64": compare(...)}}`` for ``mode`` in
    ``fp32``/``autocast`` (bf16). Puts ``model`` in eval mode and leaves it on PEFT's path.
    """
    model.eval()
    ref = _logits(flashdora.disable(copy.deepcopy(model)).double(), input_ids, autocast=False)
    results = {}
    for mode in modes:
        autocast = mode == "autocast"
        peft_out = _logits(flashdora.disable(model), input_ids, autocast)
        out = _logits(flashdora.enable(model), input_ids, autocast)
        results[mode] = {
            "flash_vs_peft": compare(out, peft_out),
            "flash_vs_f64": compare(out, ref),
            "peft_vs_f64": compare(peft_out, ref),
        }
    flashdora.disable(model)
    return results


def _step(model, opt, batch: torch.Tensor, seed: int, autocast: bool) -> float:
    """One AdamW step of next-token loss on ``batch``; ``seed`` fixes the dropout masks."""
    model.train()
    torch.manual_seed(seed)
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def nudge_magnitudes(model: torch.nn.Module) -> None:
    """Move every DoRA magnitude up by one ulp of its dtype (float32 for PEFT's adapters): the smallest change."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))


def train_pair(peft_model, batches, lr: float, autocast: bool, seed: int = 0, on_step=None, floor: bool = False):
    """Train ``peft_model`` with PEFT DoRA and a copy with flashdora in lockstep (same batches, masks, AdamW).

    Returns ``(peft_losses, flash_losses)``, and with ``floor`` a third curve: PEFT DoRA again on a copy whose
    magnitudes are one float32 ulp off (``nudge_magnitudes``), the |delta loss| any other implementation, however
    exact, can be expected to reach. ``on_step(step, peft_loss, flash_loss)`` is called after each step.
    """
    flash_model = flashdora.enable(copy.deepcopy(peft_model))
    models = [flashdora.disable(peft_model), flash_model]
    if floor:
        models.append(flashdora.disable(copy.deepcopy(peft_model)))
        nudge_magnitudes(models[-1])
    runs = [(m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)) for m in models]
    losses = tuple([] for _ in runs)
    for step, batch in enumerate(batches):
        for (model, opt), out in zip(runs, losses, strict=True):
            out.append(_step(model, opt, batch, seed * 1_000_003 + step, autocast))
        if on_step is not None:
            on_step(step, losses[0][-1], losses[1][-1])
    return losses


def make_record(args: dict, settings, fidelity, training, curves, check_list, counts, corpus) -> dict:
    """The run as one JSON-able dict: ``record.new_result``'s header, then parity's sections."""
    protocol = {
        "judge": "the same PEFT model in float64",
        "dropout_masks": "shared (one seed per step, every run)",
        "magnitude_spread": MAGNITUDE_SPREAD,
    }
    result = record.new_result("parity", settings["device"], protocol, args)
    return {
        **result,
        "settings": {**settings, "corpus_bytes": len(corpus)},
        "bars": {"cosine": COSINE_BAR, "f64_factor": F64_FACTOR, "f64_slack": F64_SLACK, "mean_abs_delta": LOSS_BAR},
        "fidelity": fidelity,
        "training": training,
        "curves": curves,
        "path_counts": counts,
        "checks": check_list,
        "passed": all(c["passed"] for c in check_list),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``flashdora parity``'s options (defined in ``flashdora.tools.cli``, whose ``--help`` imports no torch)."""
    cli.add_parity_arguments(parser)


def _settings(args: argparse.Namespace) -> dict:
    """The run's settings with device-dependent defaults resolved."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    for name in ("steps", "seeds", "rank", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"flashdora parity: --{name} expected >= 1, got {getattr(args, name)}")
    for name in ("first_seed", "pretrain"):
        if getattr(args, name) < 0:
            raise SystemExit(f"flashdora parity: --{name.replace('_', '-')} expected >= 0, got {getattr(args, name)}")
    if not (args.lora_b_ratio > 0 and args.pretrain_lr > 0):
        raise SystemExit(f"flashdora parity: --lora-b-ratio and --pretrain-lr expected > 0, got {args.lora_b_ratio}, "
                         f"{args.pretrain_lr}")  # fmt: skip
    pretrain = {"pretrain_lr": args.pretrain_lr, "lora_b_ratio": args.lora_b_ratio} if args.pretrain else {}
    return {
        "size": args.size or ("wide" if cuda else "tiny"),
        "steps": args.steps,
        "seeds": args.seeds,
        "first_seed": args.first_seed,
        "floor": args.floor,
        "pretrain": args.pretrain,
        **pretrain,
        "rank": args.rank,
        "dropout": args.dropout,
        "seq": args.seq or (512 if cuda else 64),
        "batch": args.batch,
        "lr": args.lr,
        "dtype": args.dtype or ("autocast" if cuda else "fp32"),
        "device": str(device),
        "optimizer": "AdamW (torch defaults besides lr)",
        "data": "byte-level ids (0..255) of the standard library's .py sources, random windows",
    }


def _train_seed(s: dict, seed: int, progress) -> dict[str, list[float]]:
    """One seed's training comparison: ``{"seed", "peft", "flashdora"[, "peft_floor"]}`` loss curves (with
    ``--pretrain``, also the pretraining's first and last loss and the factor applied to ``lora_B``).

    ``progress.step(seed, peft_loss, flash_loss)`` after each step.
    """
    autocast = s["dtype"] == "autocast"
    pre = sample_batches(stdlib_corpus(), s["pretrain"], s["batch"], s["seq"], seed + 10_000) if s["pretrain"] else []
    model, extra = parity_pretrain.start_model(s, seed, [b.to(s["device"]) for b in pre])
    batches = [b.to(s["device"]) for b in sample_batches(stdlib_corpus(), s["steps"], s["batch"], s["seq"], seed)]
    report = lambda _, p, f: progress.step(seed, p, f)  # noqa: E731
    losses = train_pair(model, batches, s["lr"], autocast, seed, report, floor=s["floor"])
    return {"seed": seed, **dict(zip(("peft", "flashdora", "peft_floor"), losses)), **extra}


class _Progress:
    """A rich progress bar over all steps; on a non-terminal console (logs, CI) a plain line every 10%."""

    def __init__(self, console, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console, self.total, self.done, self.start = console, total, 0, time.perf_counter()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        self.bar = Progress(*columns, console=console, transient=True)
        self.task = self.bar.add_task("training", total=total)

    def step(self, seed: int, peft_loss: float, flash_loss: float) -> None:
        self.done += 1
        desc = f"seed {seed}: loss {peft_loss:.4f} |delta| {abs(peft_loss - flash_loss):.1e}"
        self.bar.update(self.task, advance=1, description=desc)
        if not self.console.is_terminal and self.done % max(1, self.total // 10) == 0:
            elapsed = time.perf_counter() - self.start
            self.console.print(f"training: {self.done}/{self.total} steps, {elapsed:.0f} s; {desc}")


def _train_all(s: dict, console) -> list[dict[str, list[float]]]:
    """The training comparison for every seed, in order, under one progress bar."""
    seeds = range(s["first_seed"], s["first_seed"] + s["seeds"])
    progress = _Progress(console, s["steps"] * s["seeds"])
    with progress.bar:
        return [_train_seed(s, seed, progress) for seed in seeds]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if args.merge:
        return _write(merge(args.merge, args), args, console)
    s = _settings(args)
    corpus = stdlib_corpus()
    console.print(
        f"flashdora parity: Llama-style '{s['size']}', DoRA r={s['rank']}, dropout {s['dropout']}, {s['steps']} "
        f"steps x {s['seeds']} seed(s) of {s['batch']}x{s['seq']} byte tokens, {s['dtype']}, on {s['device']}"
        + (f"; base pretrained {s['pretrain']} steps first" if s["pretrain"] else "")
    )
    model = demo.build_peft_model(s["size"], s["rank"], s["dropout"], s["device"], seed=0)
    s["params"] = {
        "base": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "adapter": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    spread_magnitudes(model, seed=0)
    eval_ids = sample_batches(corpus, 1, s["batch"], s["seq"], seed=12345)[0].to(s["device"])
    flashdora.reset_stats()
    fidelity = logit_fidelity(model, eval_ids)
    del model
    curves = _train_all(s, console)
    counts = flashdora.stats()
    training = summarize_training(curves)
    result = make_record(vars(args), s, fidelity, training, curves, checks(fidelity, training, counts), counts, corpus)
    return _write(result, args, console)


def _write(result: dict, args: argparse.Namespace, console) -> int:
    """Write the JSON, Markdown and PNG, print the summary; the exit code (1 when a bar fails, unless --no-check)."""
    paths = record.write(result, args.out, render_markdown, render_png)
    print_summary(result, console)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if result["passed"] or args.no_check else 1


if __name__ == "__main__":  # ``python -m flashdora.tools.parity ...`` is ``flashdora parity ...``
    sys.exit(cli.main(["parity", *sys.argv[1:]]))
