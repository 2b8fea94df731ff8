"""``flashdora bench model --interleave``: a model per mode, all resident, every timed step running each mode once.

Without it the modes run one after another on one model (``model.run_round``), each timing its steps in a block of
its own, and a change of the host's speed between minutes (1.3-1.5x on shared machines) lands on whichever mode runs
then. Here the base is built once and copied for each mode (``copy.deepcopy``; bitsandbytes' parameters copy their
quantization state), each copy wrapped as ``run_round`` wraps the one model, and each phase's steps are timed call
by call (``timing.measure_interleaved``: step ``k`` runs every mode once, starting with the ``k``-th). A row's
``times_ms[k]`` is its call in step ``k``, so its ratio to PEFT LoRA's ``times_ms[k]`` pairs calls made next to each
other (the Markdown's "paired vs peft_lora": the median of those ratios). The cost: every mode's model, and in
``train`` every mode's optimizer state, resident at once.

Per row: ``first_ms`` is the mode's first (cold) step alone, the modes' first steps in the listed order; ``paths``
are the flashdora paths of that step; ``warmup_s`` the wall time of the mode's ``--warmup`` untimed calls (queue
drained around each); ``peak_extra_gib`` the largest of its timed calls' peaks above what was allocated right
before the call (every model resident); ``kernel_ms`` and ``host`` as ``host.view`` gives them.
"""

from __future__ import annotations

import copy
import random
import statistics
import sys
import time

import torch

import flashdora
from flashdora.tools.bench import host, timing
from flashdora.tools.bench.model_build import prepare, wrap
from flashdora.tools.bench.model_phases import SWITCHED, Feed, base_pass, mode_switch, phase_row, step_fn

ORDER = (
    "interleaved: a model per mode, all resident; each timed step runs every mode once, the start rotated step by "
    "step (the cyclic order as listed); peak memory: each call's peak above what was allocated before it"
)


def build_models(weights, args, build_s: dict) -> dict[str, torch.nn.Module]:
    """A prepared model per mode of ``args.modes``: copies of ``weights`` (the last mode takes ``weights`` itself),
    wrapped and switched as ``run_round`` does; each mode's copy-and-wrap wall time into ``build_s``."""
    models = {}
    for i, mode in enumerate(args.modes):
        t0 = time.perf_counter()
        model = prepare(weights if i == len(args.modes) - 1 else copy.deepcopy(weights), args)
        if mode != "base":
            model = wrap(model, args, use_dora=mode != "peft_lora")
            if mode not in ("peft_dora", "peft_lora"):  # PEFT's own code (enable has nothing to switch on LoRA)
                dropout = "adapter" if mode == "flashdora_adapter" else "exact"
                flashdora.enable(model, norm_cache=mode != "flashdora_nocache", dropout=dropout)
        models[mode] = model
        build_s[mode] = time.perf_counter() - t0
    return models


def measure_phase(models: dict, ids, phase: str, args, device, base_row: dict) -> list[dict]:
    """One row per mode for ``phase``, the modes' steps timed call by call."""
    rows = {mode: phase_row(model, base_row, mode, phase, args) for mode, model in models.items()}
    per = args.new_tokens if phase == "decode" else 1  # decode: times per generated token
    fns = {}
    feed = Feed(ids)
    try:
        for mode, model in models.items():  # each mode's first (cold) step alone, and the paths it took
            fn = step_fn(model, feed, phase, args)
            if mode in SWITCHED:
                fn = _switched(fn, mode)
            fns[mode] = fn
            flashdora.reset_stats()
            rows[mode]["first_ms"] = _wall_ms(fn, device) / per
            stats = flashdora.stats()  # (a compiled graph counts only its norm op's calls: "compiled")
            paths = sorted(k for k in stats if not k.startswith("norm"))
            rows[mode]["paths"] = paths or (["compiled"] if stats else [])
        warmup_s = dict.fromkeys(fns, 0.0)
        order = list(fns)
        for k in range(args.warmup):  # (rotated as the timed steps are)
            for i in range(len(order)):
                mode = order[(k + i) % len(order)]
                warmup_s[mode] += _wall_ms(fns[mode], device) / 1e3
        peaks: dict[str, float] = {}
        if args.dynamic is not None:
            times, fixed, seqs = measure_dynamic(models, fns, feed, args, device)
            tokens = round(args.batch * statistics.mean(seqs))
            for mode, row in rows.items():
                row.update(dynamic=list(args.dynamic), seqs=seqs, tokens=tokens, fixed_times_ms=fixed[mode])
        else:
            times = timing.measure_interleaved(
                fns, reps=args.reps, device=device, peaks=peaks if timing.is_cuda(device) else None
            )
        for mode, fn in fns.items():  # (untimed: the GPU's time of a step, and with --host the host's by phase)
            rows[mode].update(host.view(models[mode], fn, phase, args, device))
    except Exception as e:  # noqa: BLE001 - recorded in every row of the phase; the other phases still run
        fns = None
        timing.free_memory(device)
        error = timing.describe_error(e)
        print(f"bench model: {phase} failed: {error}", file=sys.stderr)
        return [{**row, "ms": None, "peak_extra_gib": None, "error": error} for row in rows.values()]
    fns = None  # the optimizers' states go with the step functions
    timing.free_memory(device)
    for mode, row in rows.items():
        ms = statistics.median(times[mode]) / per
        row.update(
            ms=ms,
            peak_extra_gib=peaks.get(mode),
            times_ms=[t / per for t in times[mode]],
            warmup_s=warmup_s[mode],
            tokens_per_s=row["tokens"] * (args.grad_accum if phase in ("grad", "train") else 1) / (ms * per * 1e-3),
        )
        row.update(host.gap(row))
    return [rows[mode] for mode in models]


def measure_dynamic(models: dict, fns: dict, feed: Feed, args, device) -> tuple[dict, dict, list[int]]:
    """``--dynamic``: ``args.reps`` timed steps. Each runs every mode at the fixed ``--seq``, then draws a token
    count from ``args.dynamic`` (seeded, the same for every mode), runs an untimed ``base_pass`` at it and every mode
    at it; the modes in turn, the start rotated as in ``timing.measure_interleaved``, each call's wall time with the
    queue drained around it. The dynamic times, the fixed-length times (per mode) and the counts drawn."""
    lo, hi = args.dynamic
    draw, gen = random.Random(args.seed + 3), torch.Generator().manual_seed(args.seed + 3)
    mode, model = next(((m, x) for m, x in models.items() if m != "base"), next(iter(models.items())))
    fixed_ids, vocab, names = feed.ids, model.config.vocab_size, list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    fixed: dict[str, list[float]] = {name: [] for name in names}
    seqs = []
    for k in range(args.reps):
        order = [names[(k + i) % len(names)] for i in range(len(names))]
        feed.ids = fixed_ids
        for name in order:
            fixed[name].append(_wall_ms(fns[name], device))
        seqs.append(draw.randint(lo, hi))
        feed.ids = torch.randint(0, vocab, (args.batch, seqs[-1]), generator=gen).to(device)
        base_pass(model, feed, args, adapters=mode != "base")
        for name in order:
            times[name].append(_wall_ms(fns[name], device))
    return times, fixed, seqs


def run_interleaved(weights, ids, args, device, base_row, bar, task, label, build_s) -> list[dict]:
    """Every (mode, phase) row of an ``--interleave`` run on copies of ``weights`` (``build_weights``' model)."""
    bar.update(task, description=f"{label}: a model per mode")
    try:
        models = build_models(weights, args, build_s)
    except torch.OutOfMemoryError as e:
        raise SystemExit(
            f"flashdora bench model --interleave: out of memory while building a model per mode ({len(args.modes)} "
            f"copies of {label}: {', '.join(args.modes)}); run fewer --modes, a lower --rank, or without --interleave "
            "(one model at a time)"
        ) from e
    rows = []
    for phase in args.phases:
        bar.update(task, description=f"{label}: {phase}, {len(models)} modes interleaved")
        rows += measure_phase(models, ids, phase, args, device, base_row)
        bar.advance(task, len(models))
    return rows


def _wall_ms(fn, device) -> float:
    timing.synchronize(device)
    t0 = time.perf_counter()
    fn()
    timing.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _switched(fn, mode):
    def call():
        with mode_switch(mode):
            fn()

    return call
