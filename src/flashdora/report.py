"""``report(model)``: which DoRA modules of a model run which path, and why."""

from __future__ import annotations

from collections import Counter

from torch import nn

from flashdora import backend


def _dropout(module, adapter: str, path: str) -> str:
    """``-`` without dropout, else ``p=<p> <mode>``: ``exact`` (PEFT's function) or ``adapter`` (the opt-in)."""
    from flashdora.peft.variant import dropout_mode

    layer = module.lora_dropout[adapter] if adapter in module.lora_dropout else None
    p = getattr(layer, "p", 0.0)
    if not p:
        return "-"
    return f"p={p:g} {dropout_mode(module) if path.startswith('flashdora') else 'exact'}"


def _rows(model: nn.Module) -> list[tuple[str, str, str, str, str]]:
    from peft.tuners.lora.layer import LoraLayer

    from flashdora.dispatch import explain
    from flashdora.peft.switch import layer_path

    rows = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = type(module.get_base_layer()).__name__
        for adapter in module.lora_variant:
            path = layer_path(module, adapter)
            route = f"flashdora:{explain(module, adapter)}" if path.startswith("flashdora") else path
            rows.append((name, adapter, base, route, _dropout(module, adapter, path)))
    return rows


def _headline(rows) -> str | None:
    """The first line when flashdora runs none of the model's DoRA layers and nothing says why: it was never enabled
    (or was disabled)."""
    if rows and all(r[3] == "peft" for r in rows):
        return (
            f"flashdora is not enabled on this model: its {len(rows)} DoRA layer(s) run PEFT's own code "
            "(call flashdora.enable(model), or flashdora.patch_peft() before the model is built)"
        )
    return None


def report(model: nn.Module, *, print_table: bool = True) -> str:
    """A table of every DoRA (module, adapter) of a PEFT ``model`` with its path, plus the call counters.

    On a model where every DoRA layer runs PEFT's own code (``enable`` never called, or ``disable``d), the first line
    says so and names ``enable``.

    Route: what the layer's last call ran, as ``dispatch`` recorded it: ``flashdora:<compose>/<norm>/<base>``
    (compose ``native``: the C++ forward and node over the Triton kernels, ``triton``, ``eager``, ``traced``: inside
    ``torch.compile``...; the norm: what a cache miss runs; the base: ``module``, a bitsandbytes ``layer``'s own
    call, or ``bnb``, flashdora's call of bitsandbytes' ops), ``flashdora:not run``, ``peft`` (flashdora off for
    it) or ``peft:<reason>`` (not handled: the reason says why; docs/design.md, "Routes"). Dropout:
    ``-`` (none), ``p=<p> exact`` (PEFT's function) or ``p=<p> adapter`` (``enable(..., dropout="adapter")``).
    Returns the text; prints it (through rich when installed) unless
    ``print_table=False``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"report: model expected a torch.nn.Module, got {type(model).__name__}")
    rows = _rows(model)
    totals = Counter(route.split("/")[0] for _, _, _, route, _ in rows)
    width = max([len(r[0]) for r in rows] + [6])
    headline = _headline(rows)
    lines = [headline] if headline else []
    lines += [f"{'module':<{width}}  {'adapter':<10} {'base':<12} {'route':<32} dropout"]
    lines += [f"{n:<{width}}  {a:<10} {b:<12} {r:<32} {d}" for n, a, b, r, d in rows]
    summary = ", ".join(f"{p}: {c}" for p, c in sorted(totals.items())) or "no DoRA layers found"
    lines.append(f"DoRA layers by path: {summary}")
    lines.append(f"calls since reset_stats(): {dict(sorted(backend.stats().items())) or '{}'}")
    text = "\n".join(lines)
    if print_table:
        _print(rows, lines[-2:], headline)
    return text


def _print(rows, footer, headline: str | None = None) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency, but keep report usable without it
        print("\n".join(([headline] if headline else []) + [" | ".join(r) for r in rows] + footer))
        return
    table = Table(title="flashdora report")
    table.add_column("module", no_wrap=True)
    for col in ("adapter", "base", "route", "dropout"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row, style=None if row[3].startswith("flashdora") else "yellow")
    # As wide as the table needs: at the terminal's width (80 in a log) rich cuts or folds the module names, and
    # projections differ only at their ends (``...self_attn.q_proj`` vs ``...self_attn.k_proj``).
    width = Console(width=2**16).measure(table).maximum
    console = Console()
    console = Console(width=max(console.width, width)) if width > console.width else console
    if headline:
        console.print(headline, style="yellow", soft_wrap=True)
    console.print(table)
    for line in footer:
        console.print(line)
