"""``flashdora bench layer``: one DoRA layer, PEFT LoRA vs PEFT DoRA vs flashdora, plus the kernels alone.

Each (shape, rank, dtype) builds one bf16 ``nn.Linear`` weight and wraps it with PEFT once per mode
(``build_layers``: the same ``lora_A``/``lora_B`` values, ``lora_B`` non-zero, and one magnitude for both DoRA
layers), then times every (tokens, phase, mode) on the same ``x`` and ``dy``. ``flashdora`` is a PEFT DoRA layer
after ``flashdora.enable``; ``peft_dora`` its twin after ``flashdora.disable``. ``--interleave`` times the modes call
by call instead of in blocks (``timing.measure_interleaved``). Each ``fwd_bwd`` call first marks the trainable
parameters as changed (as an optimizer step would), so flashdora recomputes its cached norm every call; ``forward``
keeps the cache (fixed weights). The kernel sections live in ``bench/kernels.py``, the tables and chart in
``bench/layer_render.py``. Protocol and result keys: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import sys
from collections import OrderedDict

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import flashdora
from flashdora.tools.bench import record, timing
from flashdora.tools.bench.kernels import bench_kernels, shape_name, timed
from flashdora.tools.bench.layer_render import MODES, PHASES, render_markdown, render_png  # noqa: F401 - for callers
from flashdora.tools.cli import LAYER_DTYPES as DTYPES  # noqa: F401 - the options are flashdora.tools.cli's; for callers
from flashdora.tools.cli import parse_shape  # noqa: F401 - for callers


def build_layer(weight: torch.Tensor, rank: int, use_dora: bool, dtype_mode: str):
    """A PEFT model around one frozen ``nn.Linear`` holding ``weight``; returns (peft_model, lora_layer)."""
    d_out, d_in = weight.shape
    linear = nn.Linear(d_in, d_out, bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    config = LoraConfig(
        r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=["proj"], use_dora=use_dora, init_lora_weights=False
    )  # False: lora_B gets nn.Linear's random init, so DoRA is not trivial
    with torch.device(weight.device):
        model = get_peft_model(
            nn.Sequential(OrderedDict(proj=linear)), config, autocast_adapter_dtype=dtype_mode == "autocast"
        )
    layer = model.base_model.model.proj
    want = torch.float32 if dtype_mode == "autocast" else torch.bfloat16
    got = {p.dtype for n, p in layer.named_parameters() if "lora_" in n}
    if got != {want}:
        raise RuntimeError(
            f"bench layer: {dtype_mode} expected adapter dtype {want}, PEFT made {sorted(map(str, got))}"
        )
    return model, layer


def step_fn(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, phase: str, autocast: bool):
    """One call of ``layer`` as the phase runs it; ``.grad``s are dropped after each call, so each allocates them."""
    device_type = x.device.type

    def amp():
        return torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    if phase == "forward":

        def forward():
            with torch.no_grad(), amp():
                layer(x)

        return forward
    params = [p for p in layer.parameters() if p.requires_grad]

    def fwd_bwd():
        # What an optimizer step does to the weights' versions: flashdora's cached norm is recomputed each step.
        torch.autograd.graph.increment_version(params)
        with amp():
            y = layer(x)
        y.backward(dy)
        x.grad = None  # dropped after each call: the baseline excludes gradients, the peak includes them
        for p in params:
            p.grad = None

    return fwd_bwd


def _measure_mode(fn, args, device, reps: int | None = None) -> dict:
    """ms / peak extra MiB of one mode and the flashdora paths it took."""
    flashdora.reset_stats()
    got = timed(fn, warmup=args.warmup, reps=args.reps if reps is None else reps, device=device)
    return {**got, "paths": sorted(k for k in flashdora.stats() if not k.startswith("norm"))}


def build_layers(weight, rank: int, dtype_mode: str, modes) -> dict:
    """One PEFT model per mode, ``{mode: (model, layer)}``, with the same ``lora_A``, ``lora_B`` and (DoRA)
    magnitude values: ``peft_dora`` pinned to PEFT's forward (``flashdora.disable``), ``flashdora`` to ours."""
    layers = {}
    for mode in modes:
        model, layer = layers[mode] = build_layer(weight, rank, mode != "peft_lora", dtype_mode)
        if mode != "peft_lora":
            (flashdora.enable if mode == "flashdora" else flashdora.disable)(model)
    dora = [layer for mode, (_, layer) in layers.items() if mode != "peft_lora"]
    src = dora[0] if dora else None  # every other layer takes its values (the magnitude too, where it has one)
    with torch.no_grad():
        for mode, (_, layer) in layers.items():
            names = ("lora_A", "lora_B") + (("lora_magnitude_vector",) if mode != "peft_lora" else ())
            for name in names if src is not None and layer is not src else ():
                getattr(layer, name)["default"].weight.copy_(getattr(src, name)["default"].weight)
    return layers


def _interleaved(layers, x, dy, phase, autocast, args, device, progress) -> dict[str, dict]:
    """Each mode's row, its calls timed in turn with every other mode's (``timing.measure_interleaved``); peak
    memory and paths from a separate run of at most 5 calls per mode. A mode that fails there is left out."""
    fns = {mode: step_fn(layers[mode][1], x, dy, phase, autocast) for mode in args.modes}
    got = {}
    for mode, fn in fns.items():
        timing.free_memory(device)
        got[mode] = _measure_mode(fn, args, device, reps=min(args.reps, 5))
        progress(mode, got[mode])
    live = {mode: fn for mode, fn in fns.items() if got[mode]["ms"] is not None}
    timing.free_memory(device)
    try:
        times = timing.measure_interleaved(live, reps=args.reps, device=device) if live else {}
    except Exception as e:  # noqa: BLE001 - recorded in every row and printed, as ``timed`` does
        timing.free_memory(device)
        error = f"interleaved: {type(e).__name__}: {e}"[:300]
        print(f"bench: rows failed: {error}", file=sys.stderr)
        return {mode: {**row, "ms": None, "error": error} for mode, row in got.items()}
    for mode, t in times.items():
        got[mode].update(ms=statistics.median(t), times_ms=t)
    return got


def bench_config(weight, rank, dtype_mode, args, device, progress) -> list[dict]:
    """All (tokens, phase, mode) rows of one (shape, rank, dtype); ``progress(case, row)`` after each measurement."""
    d_out, d_in = weight.shape
    layers = build_layers(weight, rank, dtype_mode, args.modes)
    autocast = dtype_mode == "autocast"
    rows = []
    for tokens, phase in itertools.product(args.tokens, args.phases):
        x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=phase == "fwd_bwd")
        dy = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)
        got = {mode: [] for mode in args.modes}
        case = f"{shape_name(d_in, d_out)} r={rank} {dtype_mode} {tokens} tokens {phase}"
        if args.interleave:
            step = lambda mode, row, case=case: progress(f"{case} {mode} (memory run)", row)  # noqa: E731
            for mode, row in _interleaved(layers, x, dy, phase, autocast, args, device, step).items():
                got[mode].append(row)
        for k in range(0 if args.interleave else args.rounds):  # every second round reversed (no fixed neighbour)
            for mode in args.modes if k % 2 == 0 else args.modes[::-1]:
                timing.free_memory(device)
                fn = step_fn(layers[mode][1], x, dy, phase, autocast)
                got[mode].append(_measure_mode(fn, args, device))
                progress(f"{case} {mode}", got[mode][-1])
        for mode in args.modes:
            row = {
                "shape": shape_name(d_in, d_out),
                "d_in": d_in,
                "d_out": d_out,
                "rank": rank,
                "tokens": tokens,
                "dtype": dtype_mode,
                "mode": mode,
                "phase": phase,
            }
            pooled = got[mode][0] if args.rounds == 1 else timing.pool_rounds(got[mode], "peak_extra_mib")
            rows.append({**row, **pooled})
        del x, dy
    del layers
    timing.free_memory(device)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per (shape, rank, tokens, dtype, phase): flashdora / peft_lora and peft_dora / flashdora time ratios (and
    flashdora / peft_lora round by round, where rows were pooled over rounds)."""
    by_key: dict[tuple, dict[str, float | None]] = {}
    by_round: dict[tuple, dict[str, list]] = {}
    for r in rows:
        key = (r["shape"], r["rank"], r["tokens"], r["dtype"], r["phase"])
        by_key.setdefault(key, {})[r["mode"]] = r["ms"]
        by_round.setdefault(key, {})[r["mode"]] = r.get("round_ms")

    def div(a, b):
        return None if a is None or b is None or b == 0 else a / b

    def rounds(k):
        f, lora = by_round[k].get("flashdora"), by_round[k].get("peft_lora")
        return [div(a, b) for a, b in zip(f, lora)] if f and lora else None

    return [
        {
            "shape": k[0],
            "rank": k[1],
            "tokens": k[2],
            "dtype": k[3],
            "phase": k[4],
            "flashdora_over_lora": div(ms.get("flashdora"), ms.get("peft_lora")),
            "dora_over_flashdora": div(ms.get("peft_dora"), ms.get("flashdora")),
            "flashdora_over_lora_by_round": rounds(k),
        }
        for k, ms in by_key.items()
    ]


_ORDERS = {
    (False, False): "as listed",
    (False, True): "alternating: every second round runs the modes reversed",
    (True, False): "interleaved: every timed step runs each mode once, the order rotated step by step",
}


def run(args) -> int:
    from rich.progress import Progress

    device = torch.device(args.device)  # options checked by flashdora.tools.cli.check
    torch.manual_seed(args.seed)
    protocol = {
        "warmup": args.warmup,
        "reps": args.reps,
        "rounds": args.rounds,
        "interleave": args.interleave,
        "statistic": "median" if args.rounds == 1 else "median of all rounds' timed calls (round_ms: each round's)",
        "order": _ORDERS[(args.interleave, args.rounds > 1)],
        "timer": "cuda events" if timing.is_cuda(device) else "perf_counter",
        "memory": "max_memory_allocated over the timed calls minus memory_allocated before them"
        + (" (a separate run of at most 5 calls per mode)" if args.interleave else ""),
        "lora_alpha": "= rank (scaling 1)",
        "lora_dropout": 0.0,
        "init_lora_weights": False,
    }
    result = record.new_result("layer", device, protocol, vars(args))
    configs = [] if args.kernels_only else list(itertools.product(args.shapes, args.ranks, args.dtypes))
    per_config = len(args.tokens) * len(args.phases) * len(args.modes) * args.rounds
    rows = []
    total = len(configs) * per_config
    with Progress(transient=True) as bar:
        task = bar.add_task("bench layer", total=total)

        def progress(case: str, row: dict) -> None:  # a line per measured case, also where no bar is drawn (a log)
            bar.advance(task)
            ms = "failed" if row.get("ms") is None else f"{row['ms']:.3f} ms"
            bar.console.print(f"bench layer [{int(bar.tasks[0].completed)}/{total}] {case}: {ms}", highlight=False)

        for (d_in, d_out), rank, dtype_mode in configs:
            bar.update(task, description=f"{shape_name(d_in, d_out)} r={rank} {dtype_mode}")
            weight = torch.randn(d_out, d_in, device=device, dtype=torch.bfloat16) / d_in**0.5
            rows += bench_config(weight, rank, dtype_mode, args, device, progress)
            del weight
        if not args.no_kernels:
            bar.console.print("bench layer: the kernels alone, the device's peaks and the norm comparison")
            bar.update(task, description="kernels")
            result.update(bench_kernels(args, device))
    result["rows"] = rows
    result["ratios"] = ratios(rows)
    paths = record.write(result, args.out, render_markdown, render_png)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
