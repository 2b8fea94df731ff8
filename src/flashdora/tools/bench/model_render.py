"""Markdown table and PNG chart of a ``flashdora bench model`` result (both regenerable from its JSON)."""

from __future__ import annotations

from flashdora.tools.bench import record
from flashdora.tools.bench.host import PHASES as HOST_PHASES

MODES = (
    "base", "peft_lora", "peft_dora", "flashdora", "flashdora_python", "flashdora_split", "flashdora_nocache",
    "flashdora_adapter",
)  # fmt: skip
PHASES = ("inference", "grad", "train", "decode")


def render_markdown(result: dict) -> str:
    """The model table, from a result JSON: time, throughput, ratios and memory per (mode, phase)."""
    recs = result["records"]
    ms = {(r["preset"], r["phase"], r["mode"]): r["ms"] for r in recs}
    round_ms = {(r["preset"], r["phase"], r["mode"]): r.get("round_ms") for r in recs}

    def by_round(r):  # each round's median over PEFT LoRA's median of the same round (run minutes apart at most)
        this, lora = r.get("round_ms"), round_ms.get((r["preset"], r["phase"], "peft_lora"))
        if not this or not lora or r["mode"] == "peft_lora":
            return "-"
        return " / ".join(f"{a / b:.2f}" for a, b in zip(this, lora))

    def ratio(r, mode):
        other = ms.get((r["preset"], r["phase"], mode))
        return None if r["ms"] is None or not other else r["ms"] / other

    by_mode = {(r["preset"], r["phase"], r["mode"]): r for r in recs}

    def paired(r, field="times_ms"):  # (--dynamic: "fixed_times_ms" too)
        this, lora = r.get(field), by_mode.get((r["preset"], r["phase"], "peft_lora"), {}).get(field)
        if not this or not lora or r["mode"] == "peft_lora" or r["ms"] is None:
            return None
        return record.paired_ratio(this, lora)

    rounds = any("round_ms" in r for r in recs)
    gpu = any(r.get("kernel_ms") is not None for r in recs)
    profiled = max((len(r.get("kernel_ms_steps") or [0]) for r in recs), default=1)  # (older files kept one step's)
    interleaved = record.interleaved(result)
    columns = [
        "preset",
        "phase",
        "mode",
        "r",
        "tokens",
        "ms",
        *(["each round's median ms"] if rounds else []),
        *(["GPU ms", "host gap ms"] if gpu else []),
        "tokens/s",
        "vs base",
        "vs peft_lora",
        *(["vs peft_lora by round"] if rounds else []),
        *(["paired vs peft_lora"] if interleaved else []),
        "peft_dora / this",
        "peak extra GiB",
        "first ms",
        "warm-up s",
        "paths",
    ]
    rows = []
    for r in sorted(recs, key=lambda r: (r["preset"], PHASES.index(r["phase"]), MODES.index(r["mode"]))):
        dora = ms.get((r["preset"], r["phase"], "peft_dora"))
        rows.append(
            [
                r["preset"],
                r["phase"],
                r["mode"],
                r["rank"],
                r["tokens"],
                r["ms"],
                *([" / ".join(f"{v:.1f}" for v in r.get("round_ms", []))] if rounds else []),
                *([r.get("kernel_ms"), r.get("host_gap_ms")] if gpu else []),
                r.get("tokens_per_s"),
                ratio(r, "base"),
                ratio(r, "peft_lora"),
                *([by_round(r)] if rounds else []),
                *([paired(r)] if interleaved else []),
                None if not r["ms"] or dora is None else dora / r["ms"],
                r["peak_extra_gib"],
                r.get("first_ms"),
                r.get("warmup_s"),
                " ".join(r.get("paths") or []) or r.get("error") or "-",
            ]
        )
    build = ", ".join(f"{k} {v:.1f} s" for k, v in result.get("build_s", {}).items())
    return (
        "\n".join(
            [
                record.header(result, f"flashdora bench model: {result['config']['name']}"),
                f"- model: {result['config']}",
                f"- build/wrap wall time: {build}",
                "",
                "ms: median per step (grad: forward + backward, optimizer excluded; with rounds, over every "
                "round's steps); peak extra GiB: above the resident model and adapters; warm-up s: wall time of the "
                f"{result['protocol']['warmup']} untimed steps before them (the first round's with rounds): Triton's "
                "compiles and autotuning, cuBLAS's first calls; first ms: wall time "
                "of the first (cold) step alone."
                + (
                    " GPU ms: the device time of a step's kernels, copies and fills (torch.profiler), "
                    + (f"the median of {profiled} more steps" if profiled > 1 else "in one more step")
                    + "; host gap ms: ms minus GPU ms, the time the GPU waited for the host."
                    if gpu
                    else ""
                ),
                *_phase_notes(result),
                *_dynamic_note(recs, paired),
                *(
                    [
                        "- " + result["protocol"]["order"] + "; paired vs peft_lora: the median over "
                        "timed steps of each step over PEFT LoRA's step of the same rotation (run next to it), which "
                        "the host's drifts move less than a ratio of medians"
                    ]
                    if interleaved
                    else []
                ),
                "",
                record.table(columns, rows),
                *_host_table(recs),
            ]
        )
        + "\n"
    )


def _host_table(recs: list[dict]) -> list[str]:
    """``--host``'s table: host time of a LoRA layer call by phase, per (mode, phase) row."""
    rows = [r for r in recs if r.get("host")]
    if not rows:
        return []

    def cell(h, unit=1.0):
        if not h or h["us"] is None:
            return "-"
        py = h.get("py_calls")
        return f"{h['us'] / unit:.1f} ({h['calls']}" + ("" if py is None else f"; {py:.0f} py") + ")"

    table = [
        [r["preset"], r["phase"], r["mode"], *(cell(r["host"].get(p)) for p in HOST_PHASES[:-1]),
         cell(r["host"].get("optimizer"), 1e3)]
        for r in sorted(rows, key=lambda r: (r["preset"], PHASES.index(r["phase"]), MODES.index(r["mode"])))
    ]  # fmt: skip
    columns = ["preset", "phase", "mode", "forward us", "recompute us", "backward us", "norm miss us", "optimizer ms"]
    return [
        "",
        "Host time by phase (`--host`, one more step with timers): median per LoRA layer call in us (calls in the "
        "step; py: the median Python-level calls per call, functions and builtins, counted in a further step); "
        "backward: of the node a layer call returns (flashdora's compose; PEFT LoRA's last op); norm miss: part of "
        "the forward; optimizer: the step, hooks included, in ms. Each span but the norm miss starts with the GPU's "
        "queue drained, so that it is the host's own time.",
        "",
        record.table(columns, table),
    ]


def _dynamic_note(recs: list[dict], paired) -> list[str]:
    """``--dynamic``'s line: the counts drawn and, per mode, the paired ratio at the fixed length of the same run."""
    dyn = [r for r in recs if r.get("dynamic")]
    if not dyn:
        return []
    lo, hi = dyn[0]["dynamic"]
    fixed = [
        f"{r['phase']} {r['mode']} {record.fmt(paired(r, 'fixed_times_ms'))}" for r in dyn if r["mode"] != "peft_lora"
    ]
    seqs = ", ".join(map(str, dyn[0]["seqs"]))
    return [
        f"- dynamic: each timed step drew the tokens per sequence from {lo}..{hi} ({seqs}; "
        "tokens: their mean times the batch), the same for every mode, after an untimed forward and backward with the "
        f"adapters off at that count; each step also ran every mode at {dyn[0]['seq']} tokens per sequence, with the "
        "same timer (wall, queue drained around each call): paired vs peft_lora at that fixed length: "
        + "; ".join(fixed)
    ]


def _phase_notes(result: dict) -> list[str]:
    """One line per phase present whose step the table's note does not describe."""
    phases = {r["phase"] for r in result["records"]}
    notes = []
    if "train" in phases:
        notes.append(
            f"- train: forward + backward + optimizer step; optimizer: {result['protocol']['optimizer']}; train's "
            "peak extra GiB is above its optimizer state too"
        )
    if "decode" in phases:
        notes.append(f"- decode: {result['protocol']['decode']}; tokens: generated per step (tokens/s likewise)")
    return notes


def render_png(result: dict, path) -> None:
    """Time and peak extra memory per mode, one bar group per phase."""
    recs = result["records"]
    phases = [p for p in PHASES if any(r["phase"] == p for r in recs)]
    modes = [m for m in MODES if any(r["mode"] == m for r in recs)]
    look = {(r["phase"], r["mode"]): r for r in recs}
    fig, axes = record.figure(1, 2, (11, 4))
    ms_label = "ms per step (decode: per token)" if "decode" in phases else "ms per step"
    for ax, (field, label) in zip(axes[0], [("ms", ms_label), ("peak_extra_gib", "peak extra GiB")], strict=True):
        series = {m: [look.get((p, m), {}).get(field) for p in phases] for m in modes}
        record.grouped_bars(ax, phases, series, label)
        ax.set_title(f"{result['config']['name']}, r={recs[0]['rank'] if recs else '-'}: {label}", fontsize=9)
        if any(v is not None for vals in series.values() for v in vals):
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured on this device", ha="center", transform=ax.transAxes)
    record.save(fig, path)
