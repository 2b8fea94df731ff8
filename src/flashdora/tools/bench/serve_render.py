"""Markdown table, PNG chart and terminal table of a ``flashdora bench serve`` result (all regenerable from its
JSON)."""

from __future__ import annotations

from flashdora.tools.bench import record

MODES = ("peft_lora_one", "peft_lora_mixed", "peft_dora_loop", "flashdora_mixed")
_COLUMNS = (
    "K",
    "r",
    "mode",
    "prefill ms",
    "x lora_one",
    "decode ms/step",
    "x lora_one",
    "tokens/s",
    "peak GiB",
    "paths",
)


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["rank"], r["adapters"], MODES.index(r["mode"])))


def _cells(row: dict) -> list:
    """One table row: K, r, mode, the times and their ratios to ``peft_lora_one``, throughput, memory, paths."""
    return [
        row["adapters"],
        row["rank"],
        row["mode"],
        row["prefill_ms"],
        row.get("prefill_vs_lora_one"),
        row["decode_ms_per_token"],
        row.get("decode_vs_lora_one"),
        None if row.get("decode_tokens_per_s") is None else round(row["decode_tokens_per_s"]),
        row.get("peak_mem_gib"),
        " ".join(row.get("paths") or []) or row.get("error") or "-",
    ]


def _exactness(result: dict) -> list[str]:
    """One line per (K, r): how many greedy tokens flashdora_mixed shares with PEFT DoRA run per sub-batch."""
    lines = []
    for c in result.get("combos", []):
        if c.get("token_match") is not None:
            lines.append(
                f"- K={c['adapters']}, r={c['rank']}: first generated token equal for "
                f"{c['first_token_match']:.0%} of requests, {c['token_match']:.1%} of all generated tokens "
                f"equal; adapters {c['adapter_param_gib']:.3g} GiB"
            )
    return lines


def render_markdown(result: dict) -> str:
    """The serve table, from a result JSON: per (K, r, mode), prefill and decode time, ratios and memory."""
    p = result["protocol"]
    lines = [
        record.header(result, f"flashdora bench serve: {result['config']['name']}"),
        f"- model: {result['config']}; base parameters {result['param_gib']:.3g} GiB",
        "",
        f"{p['requests']} requests per batch, request i on adapter i % K. prefill ms: one forward of "
        f"{p['prefill_prompt']} tokens per request; decode ms/step: one greedy step of the whole batch with the KV "
        f"cache (mean over {p['new_tokens']} steps after a {p['prompt']}-token prompt); medians over "
        f"{p['reps']} interleaved steps; x lora_one: over peft_lora_one's (PEFT LoRA, one adapter for the whole "
        "batch) in the same (K, r); tokens/s: generated per second by the batch; peak GiB: max_memory_allocated over "
        "the mode's calls, model included; paths: flashdora's routes (flashdora.stats()).",
        "",
        "Greedy tokens of flashdora_mixed vs peft_dora_loop in the first step (a low-precision argmax may flip on "
        "near-ties, and a flip changes the rest of that request's tokens):",
        *(_exactness(result) or ["- not compared (both modes are needed)"]),
        "",
        record.table(_COLUMNS, [_cells(r) for r in _sorted(result["rows"])]),
    ]
    return "\n".join(lines) + "\n"


def render_png(result: dict, path) -> None:
    """Decode ms per step vs K, one line per mode, one panel per rank."""
    rows = result["rows"]
    ranks = sorted({r["rank"] for r in rows})
    fig, axes = record.figure(1, len(ranks), (5 * len(ranks), 4))
    for ax, rank in zip(axes[0], ranks, strict=True):
        for mode in MODES:
            points = sorted(
                (r["adapters"], r["decode_ms_per_token"])
                for r in rows
                if r["rank"] == rank and r["mode"] == mode and r["decode_ms_per_token"] is not None
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted({r["adapters"] for r in rows}), labels=[str(k) for k in sorted({r["adapters"] for r in rows})]
        )
        ax.set_xlabel("adapters K in the batch")
        ax.set_ylabel("decode ms per step (whole batch)")
        ax.set_title(f"{result['config']['name']}, r={rank}, {result['protocol']['requests']} requests", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    record.save(fig, path)


def print_table(result: dict, console) -> None:
    """The serve table on the terminal (rich)."""
    from rich.table import Table

    table = Table(
        title=f"flashdora bench serve: {result['config']['name']}, {result['protocol']['requests']} requests"
    )
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column in ("mode", "paths") else "right")
    for row in _sorted(result["rows"]):
        table.add_row(*(record.fmt(v) for v in _cells(row)))
    console.print(table)
    for line in _exactness(result):
        console.print(line[2:])
