"""Markdown table and PNG chart of a ``flashdora bench fsdp`` result (both regenerable from its JSON): step times,
ratios and peaks per row, the loss gaps of ``--mp both`` and the paired ratios of ``--interleave``."""

from __future__ import annotations

from flashdora.tools.bench import record

MODES = ("peft_lora", "peft_dora", "flashdora")


def render_markdown(result: dict) -> str:
    recs = result["records"]
    ms = {(r["r"], r.get("mp", "bf16"), r["mode"]): r.get("ms") for r in recs}
    rows = []
    for rec in sorted(recs, key=lambda x: (x["r"], x.get("mp", "bf16"), MODES.index(x["mode"]))):
        key = (rec["r"], rec.get("mp", "bf16"))
        lora, dora, this = ms.get((*key, "peft_lora")), ms.get((*key, "peft_dora")), rec.get("ms")
        losses = rec.get("losses") or [None]
        rows.append([
            rec.get("preset"), rec["r"], rec.get("mp", "bf16"), rec["mode"], this,
            None if not (this and lora) else this / lora, None if not (this and dora) else dora / this,
            _peak(rec), rec.get("first_s"), rec.get("norms_per_step"), losses[-1], rec.get("error", ""),
        ])  # fmt: skip
    columns = ["preset", "r", "mp", "mode", "step ms", "vs peft_lora", "peft_dora / this", "peak GiB per GPU",
               "first step s", "norms per step", "last loss", "error"]  # fmt: skip
    text = record.header(result, "flashdora bench fsdp") + "\n\n" + record.table(columns, rows) + "\n"
    gaps = _gaps(recs)
    if gaps:
        text += ("\nLoss against PEFT DoRA's row without a policy (mp off), step by step from the first: the "
                 "largest and the last absolute gap.\n\n")  # fmt: skip
        rows = [
            [rec["r"], rec.get("mp", "bf16"), rec["mode"], f"{max(map(abs, gap)):.4f}", f"{abs(gap[-1]):.4f}"]
            for rec, gap in gaps
        ]
        text += record.table(["r", "mp", "mode", "largest gap", "last gap"], rows) + "\n"
    paired = _paired(result)
    if paired:
        text += (
            "\nInterleaved: the median over timed steps of each step's time over PEFT LoRA's step of the same "
            "rotation (run next to it), which the host's drifts move less than a ratio of medians.\n\n"
        )
        text += record.table(["r", "mp", "mode", "paired vs peft_lora"], paired) + "\n"
    return text


def _paired(result: dict) -> list:
    """``[r, mp, mode, ratio]`` for each row of an ``--interleave`` run but PEFT LoRA's: the median over timed steps
    of its step time over PEFT LoRA's step of the same rotation."""
    if not record.interleaved(result):
        return []
    recs = result["records"]
    lora = {(r["r"], r.get("mp")): r.get("times_ms") for r in recs if r["mode"] == "peft_lora"}
    rows = []
    for rec in recs:
        base = lora.get((rec["r"], rec.get("mp")))
        if rec["mode"] == "peft_lora" or not base or not rec.get("times_ms"):
            continue
        rows.append([rec["r"], rec.get("mp"), rec["mode"], record.paired_ratio(rec["times_ms"], base)])
    return rows


def _peak(rec: dict):
    """A row's peak memory per GPU: ``max_memory_allocated``, or with ``--interleave`` (every mode's model resident)
    its steps' peak above what was allocated before each, marked ``+``."""
    extra = rec.get("peak_extra_gib")
    return f"+{extra:.2f}" if extra is not None else rec.get("peak_gib")


def _gaps(recs: list) -> list:
    """``(row, [loss - reference per step])`` for each row with a reference: PEFT DoRA's row of the same r without a
    policy (``mp off``: float32 parameters; with ``--meta``, float32 adapters under bf16 autocast)."""
    refs = {r["r"]: r["losses"] for r in recs if r["mode"] == "peft_dora" and r.get("mp") == "off" and r.get("losses")}
    return [
        (rec, [a - b for a, b in zip(rec["losses"], refs[rec["r"]])])
        for rec in recs
        if rec["r"] in refs and rec.get("losses") and not (rec["mode"] == "peft_dora" and rec.get("mp") == "off")
    ]


def render_png(result: dict, path) -> None:
    """Each row's loss per step (rows with at least 3 steps), one panel per rank; nothing without such rows."""
    recs = [r for r in result["records"] if len(r.get("losses") or ()) >= 3]
    if not recs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["r"] for r in recs})
    gaps = _gaps(recs)
    fig, axes = plt.subplots(2 if gaps else 1, len(ranks), figsize=(6 * len(ranks), 8 if gaps else 4), squeeze=False)

    def curve(ax, rec, values):  # bf16 rows solid, the others dashed
        style = "-" if rec.get("mp", "bf16") == "bf16" else "--"
        ax.plot(range(len(values)), values, style, label=f"{rec['mode']} (mp {rec.get('mp')})")

    for ax, rank in zip(axes[0], ranks):
        for rec in (r for r in recs if r["r"] == rank):
            curve(ax, rec, rec["losses"])
        ax.set(title=f"r = {rank}", xlabel="step", ylabel="loss (mean over ranks)")
        ax.legend(fontsize=8)
    for ax, rank in zip(axes[1] if gaps else (), ranks):
        mine = [(rec, gap) for rec, gap in gaps if rec["r"] == rank]
        for rec, gap in mine:
            curve(ax, rec, gap)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set(title=f"r = {rank}: loss - PEFT DoRA's without a policy", xlabel="step", ylabel="loss gap")
        if mine:  # (a rank without PEFT DoRA's mp-off row has no gaps to plot)
            ax.legend(fontsize=8)
    fig.suptitle(f"flashdora bench fsdp: {result['device'].get('name', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
