"""Markdown table and PNG chart of a ``flashdora bench layer`` result (both regenerable from its JSON)."""

from __future__ import annotations

from flashdora.tools.bench import record
from flashdora.tools.bench.kernels import render_kernels

MODES = ("peft_lora", "peft_dora", "flashdora")
PHASES = ("forward", "fwd_bwd")


def render_markdown(result: dict) -> str:
    """The layer tables, from a result JSON."""
    ms = {(r["shape"], r["rank"], r["tokens"], r["dtype"], r["phase"], r["mode"]): r for r in result["rows"]}
    columns = [
        "shape",
        "r",
        "tokens",
        "dtype",
        "phase",
        "LoRA ms",
        "DoRA ms",
        "flashdora ms",
        "flashdora/LoRA",
        "DoRA/flashdora",
        "LoRA MiB",
        "DoRA MiB",
        "flashdora MiB",
    ]
    lines = []
    for q in result["ratios"]:
        key = (q["shape"], q["rank"], q["tokens"], q["dtype"], q["phase"])
        got = [ms.get((*key, m), {}) for m in MODES]
        lines.append(
            [
                *key,
                *(g.get("ms") for g in got),
                q["flashdora_over_lora"],
                q["dora_over_flashdora"],
                *(g.get("peak_extra_mib") for g in got),
            ]
        )
    n_rounds = result["protocol"].get("rounds", 1)
    if n_rounds > 1:
        columns.append("flashdora/LoRA by round")
        for line, q in zip(lines, result["ratios"]):
            by_round = q.get("flashdora_over_lora_by_round")
            line.append(", ".join(f"{v:.2f}" for v in by_round) if by_round and None not in by_round else None)
    pooled = f"pooled over {n_rounds} rounds in alternating order; " if n_rounds > 1 else ""
    if result["protocol"].get("interleave"):
        pooled = "the modes timed call by call in rotating order; "
    out = [record.header(result, "flashdora bench layer")]
    if result["rows"]:  # (none with --kernels-only)
        out += [
            "",
            f"Median ms per call ({pooled}DoRA = PEFT's DoRA); MiB: peak memory above the resident layer and inputs.",
            "",
            record.table(columns, lines),
        ]
    out += render_kernels(result)
    return "\n".join(out) + "\n"


def render_png(result: dict, path) -> None:
    """Time and peak extra memory relative to PEFT LoRA, per phase, for the first dtype of the run."""
    rows = result["rows"]
    if not rows:  # --kernels-only: no layer timed
        fig, axes = record.figure(1, 1, (7, 2))
        axes[0][0].text(0.5, 0.5, "no layer timed (--kernels-only): see the Markdown", ha="center", va="center")
        axes[0][0].set_axis_off()
        record.save(fig, path)
        return
    dtype = rows[0]["dtype"]
    phases = [p for p in PHASES if any(r["phase"] == p for r in rows)] or ["forward"]
    fig, axes = record.figure(len(phases), 2, (14, 4 * len(phases)))
    for i, phase in enumerate(phases):
        sel = [r for r in rows if r["phase"] == phase and r["dtype"] == dtype]
        keys = list(dict.fromkeys((r["shape"], r["rank"], r["tokens"]) for r in sel))
        look = {(r["shape"], r["rank"], r["tokens"], r["mode"]): r for r in sel}
        for j, (field, label) in enumerate([("ms", "time"), ("peak_extra_mib", "peak extra memory")]):
            series = {}
            for mode in MODES:
                vals = []
                for k in keys:
                    v, base = look.get((*k, mode), {}).get(field), look.get((*k, "peft_lora"), {}).get(field)
                    vals.append(None if v is None or not base else v / base)
                if any(v is not None for v in vals):
                    series[mode] = vals
            labels = [f"{s} r{r} t{t}" for s, r, t in keys]
            record.grouped_bars(axes[i][j], labels, series, f"{label} / PEFT LoRA")
            axes[i][j].axhline(1.0, color="k", lw=0.6)
            axes[i][j].set_title(f"{phase}, {dtype}: {label} relative to PEFT LoRA", fontsize=9)
            if series:
                axes[i][j].legend(fontsize=7)
            else:
                axes[i][j].text(0.5, 0.5, "not measured on this device", ha="center", transform=axes[i][j].transAxes)
    record.save(fig, path)
