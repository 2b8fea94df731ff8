"""``flashdora parity`` outputs from a result dict: the Markdown table, the PNG of the curves, the console summary."""

from __future__ import annotations

from pathlib import Path

from flashdora.tools.bench import record

LOSS_BAR = 1e-3  # mean per-step |loss delta| (issue 5: 2000 steps x 3 seeds, bf16 autocast, r = 384)


def _fmt(value: float) -> str:
    """Integers as they are, cosines with 8 decimals (the bars are 1 - 1e-5 and 1 - 1e-4), others as 1.234e-05."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.8f}" if 0.9 < value <= 1.0 else f"{value:.3e}"


def _check_rows(result: dict) -> list[list[str]]:
    return [
        [c["name"], _fmt(c["value"]), f"{c['op']} {_fmt(c['bar'])}", "pass" if c["passed"] else "FAIL"]
        for c in result["checks"]
    ]


def render_markdown(result: dict) -> str:
    """The checks table, from a result JSON."""
    s, json_name = result["settings"], result.get("json_name") or f"{record.stem(result)}.json"
    lines = [
        record.header(result, "flashdora parity"),
        "",
        f"Llama-style `{s['size']}`, DoRA r={s['rank']}, dropout {s['dropout']}, {s['steps']} steps x {s['seeds']} "
        f"seed(s) of {s['batch']}x{s['seq']} byte tokens, {s['dtype']}, lr {s['lr']}. "
        f"Generated from [{json_name}]({json_name}).",
        "",
        record.table(["check", "value", "bar", ""], _check_rows(result)),
    ]
    if "sources" in result:
        # a source run outside a git checkout has no commit (record.git_state)
        merged = ", ".join(f"[{x['file']}]({x['file']}) ({(x['commit'] or 'unknown')[:7]})" for x in result["sources"])
        lines += ["", f"Merged (`--merge`) from {merged}; the logit checks are the first file's."]
    t = result["training"]
    lines += ["", f"Training |delta loss| vs PEFT DoRA: mean {t['mean_abs_delta']:.3e}, max {t['max_abs_delta']:.3e}."]
    if "floor_mean_abs_delta" in t:
        lines[-1] += (
            f" Noise floor (PEFT DoRA vs PEFT DoRA with every magnitude one float32 ulp off, same run): mean "
            f"{t['floor_mean_abs_delta']:.3e}, max {t['floor_max_abs_delta']:.3e}."
        )
    return "\n".join(lines) + "\n"


def _running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def render_png(result: dict, path: Path) -> None:
    """Both training curves per seed (top) and the |loss delta| per seed, a running mean, beside the noise floor
    (bottom): raw per-step deltas of several seeds are a thicket; the mean is what the bar reads."""
    fig, axes = record.figure(2, 1, (9, 7))
    top, bottom = axes[0][0], axes[1][0]
    bottom.sharex(top)
    steps = len(result["curves"][0]["peft"]) if result["curves"] else 1
    window = max(1, steps // 40)
    for i, c in enumerate(result["curves"]):
        color = f"C{i}"
        top.plot(c["peft"], lw=1.2, color=color, label=f"PEFT DoRA, seed {c['seed']}")
        top.plot(c["flashdora"], lw=1.0, ls="--", color=color, alpha=0.7, label=f"flashdora, seed {c['seed']}")
        deltas = [abs(a - b) for a, b in zip(c["peft"], c["flashdora"], strict=True)]
        label = f"flashdora vs PEFT, seed {c['seed']}"
        bottom.semilogy(_running_mean(deltas, window), lw=1.2, color=color, label=label)
        if "peft_floor" in c:
            floor = [abs(a - b) for a, b in zip(c["peft"], c["peft_floor"], strict=True)]
            bottom.semilogy(
                _running_mean(floor, window), lw=1.0, ls=":", color=color,
                label=f"PEFT vs PEFT 1 ulp off (noise floor), seed {c['seed']}",
            )  # fmt: skip
    bottom.axhline(LOSS_BAR, color="red", ls="--", lw=0.8, label=f"bar on the mean ({LOSS_BAR:g})")
    s = result["settings"]
    top.set(
        ylabel="training loss",
        title=f"PEFT DoRA vs flashdora: {s['size']}, r={s['rank']}, {s['dtype']}, {result['device']['name']}",
    )
    bottom.set(xlabel="step", ylabel=f"|delta loss|, running mean of {window} steps")
    top.legend(fontsize=7, ncol=2)
    bottom.legend(fontsize=7)
    record.save(fig, path)


def print_summary(result: dict, console) -> None:
    from rich.table import Table

    table = Table(title="flashdora parity (vs PEFT DoRA, same weights, inputs, seeds and dropout masks)")
    for col in ("check", "value", "bar", ""):
        table.add_column(col, justify="left" if col == "check" else "right")
    for name, value, bar, verdict in _check_rows(result):
        table.add_row(name, value, bar, f"[green]{verdict}" if verdict == "pass" else f"[red]{verdict}")
    console.print(table)
    t = result["training"]
    console.print(
        f"max |delta loss| {t['max_abs_delta']:.2e}, mean {t['mean_abs_delta']:.2e}"
        + (f" (noise floor: mean {t['floor_mean_abs_delta']:.2e})" if "floor_mean_abs_delta" in t else "")
        + "; "
        f"flashdora path counters: {dict(sorted(result['path_counts'].items()))}"
    )
