"""``flashdora bench model``: a whole model from a transformers config, random weights, base vs LoRA vs DoRA.

The base model is built once (bf16, gradient checkpointing on) and wrapped in turn: PEFT LoRA (then unloaded),
PEFT DoRA (timed as ``peft_dora`` after ``flashdora.disable``, as ``flashdora`` after ``flashdora.enable``, as
``flashdora_python`` as ``flashdora`` with ``FLASHDORA_NATIVE=0`` (the Python compose, for an A/B of the C++ one in
one launch), as ``flashdora_split`` as ``flashdora`` with the C++ layer call off (the base layer called as a module:
an A/B of the layer call), as ``flashdora_nocache`` after ``flashdora.enable(norm_cache=False)`` and as
``flashdora_adapter`` after ``flashdora.enable(dropout="adapter")``, then unloaded). Phases (``inference``, ``grad``,
``train``, ``decode``) and what each step does: bench/model_phases.py. ``grad`` and ``train`` change (or mark as
changed) the weights every step, so flashdora's norm cache recomputes the norm once per step, as in real training;
``inference`` and ``decode`` keep the cache (weights are fixed). ``train`` really updates the adapters (AdamW,
lr 1e-5), so the modes after it on the same PEFT model start from slightly different values.
Adapters target every linear projection, ``lora_alpha = rank``, ``lora_dropout = --dropout`` (default 0),
``init_lora_weights=False`` (random non-zero ``lora_B``), the same seed before each wrap. Protocol and result keys:
docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import time

import torch

import flashdora
from flashdora.tools.bench import host, record, timing
from flashdora.tools.bench.model_build import TARGETS, build_base, build_config, build_weights, default_rank, wrap
from flashdora.tools.bench.model_interleave import ORDER, run_interleaved
from flashdora.tools.bench.model_phases import TRAIN_OPTIMIZER, first_call_timed, mode_switch, phase_row, step_fn
from flashdora.tools.bench.model_render import MODES, PHASES, render_markdown, render_png  # noqa: F401 - for callers


def measure_mode(target, mode, ids, args, device, base_row, bar, task, label) -> list[dict]:
    """Every phase of one built mode."""
    rows = []
    for phase in args.phases:
        bar.update(task, description=f"{label}: {mode} {phase}")
        timing.free_memory(device)
        flashdora.reset_stats()
        row = phase_row(target, base_row, mode, phase, args)
        try:
            step, first = first_call_timed(step_fn(target, ids, phase, args), device)
            m = timing.measure(step, warmup=args.warmup, reps=args.reps, device=device)
            per = args.new_tokens if phase == "decode" else 1  # decode: times per generated token
            row.update(
                ms=m.ms / per,
                peak_extra_gib=m.peak_extra_gib,
                times_ms=[t / per for t in m.times_ms],
                warmup_s=m.warmup_s,
                tokens_per_s=row["tokens"] * (args.grad_accum if phase in ("grad", "train") else 1) / (m.ms * 1e-3),
                first_ms=first[0] / per,
            )
            row.update(host.view(target, step, phase, args, device))
            row.update(host.gap(row))
        except Exception as e:  # noqa: BLE001 - recorded in the row and printed; the other modes still run
            timing.free_memory(device)
            error = timing.describe_error(e)
            print(f"bench model: {mode} {phase} failed: {error}", file=sys.stderr)
            row.update(ms=None, peak_extra_gib=None, error=error)
        stats = flashdora.stats()  # a compiled graph counts only its norm op's calls: name the path "compiled"
        row["paths"] = sorted(k for k in stats if not k.startswith("norm")) or (["compiled"] if stats else [])
        rows.append(row)
        bar.advance(task)
    return rows


def run_round(model, ids, args, device, base_row, bar, task, label, build_s, reverse=False):
    """Every mode once on ``model`` (wrapped, timed, unloaded): ``(the unwrapped model, rows)``.

    ``reverse``: the wrapped modes in the opposite order (DoRA's last first, LoRA last), so that rounds alternate
    the order and no mode always runs in the same position after the others (``base`` always runs first)."""
    rows = []
    if "base" in args.modes:
        rows += measure_mode(model, "base", ids, args, device, base_row, bar, task, label)
    dora_modes = [
        "peft_dora", "flashdora", "flashdora_python", "flashdora_split", "flashdora_nocache", "flashdora_adapter",
    ]  # fmt: skip
    groups = [(False, ["peft_lora"]), (True, dora_modes)]
    if reverse:
        groups = [(use_dora, modes[::-1]) for use_dora, modes in groups[::-1]]
    for use_dora, modes in groups:
        modes = [m for m in modes if m in args.modes]
        if not modes:
            continue
        bar.update(task, description=f"{label}: wrapping for {'DoRA' if use_dora else 'LoRA'}")
        t0 = time.perf_counter()
        peft_model = wrap(model, args, use_dora)
        build_s.setdefault("peft_dora" if use_dora else "peft_lora", time.perf_counter() - t0)
        for mode in modes:
            if mode in ("peft_dora", "peft_lora"):  # PEFT's own code (enable has nothing to switch on LoRA)
                flashdora.disable(peft_model)
            else:
                dropout = "adapter" if mode == "flashdora_adapter" else "exact"
                flashdora.enable(peft_model, norm_cache=mode != "flashdora_nocache", dropout=dropout)
            with mode_switch(mode):
                rows += measure_mode(peft_model, mode, ids, args, device, base_row, bar, task, label)
        model = peft_model.unload()
        del peft_model
        timing.free_memory(device)
    return model, rows


def pool_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per (mode, phase) from the rows of each round: all timed steps pooled, their median as ``ms``, each
    round's median in ``round_ms``, the largest peak; a row that failed in any round keeps that round's error."""
    if len(rounds) == 1:
        return rounds[0]
    by_key = {}
    for rows in rounds:  # (rounds alternate the modes' order: rows meet by mode and phase, in the first's order)
        for r in rows:
            by_key.setdefault((r["mode"], r["phase"]), []).append(r)
    pooled = []
    for same in by_key.values():
        row = timing.pool_rounds(same, "peak_extra_gib")
        if row["ms"] is not None:
            row["round_warmup_s"] = [r["warmup_s"] for r in same]  # (``warmup_s``: the first round's, compiles too)
            row["round_first_ms"] = [r["first_ms"] for r in same]  # (``first_ms``: the first round's)
            row["tokens_per_s"] = row["tokens_per_s"] * same[0]["ms"] / row["ms"]
            row.update(host.gap(row))  # (the first round's kernel time against the pooled median)
        pooled.append(row)
    return pooled


def _order(args) -> str:
    if args.interleave:
        return ORDER
    return "as listed" if args.rounds == 1 else "alternating: every second round runs the modes reversed"


def run(args) -> int:
    from rich.progress import Progress

    device = torch.device(args.device)  # options checked by flashdora.tools.cli.check
    name, config = build_config(args)
    if args.rank is None:
        args.rank = default_rank(config)
    protocol = {
        "warmup": args.warmup,
        "reps": args.reps,
        "rounds": args.rounds,
        "statistic": "median" if args.rounds == 1 else "median of all rounds' timed steps (round_ms: each round's)",
        "order": _order(args),
        "timer": "cuda events" if timing.is_cuda(device) else "perf_counter",
        "memory": "max_memory_allocated over the timed steps minus memory_allocated before them (GiB)"
        if not args.interleave
        else "each timed step's max_memory_allocated minus memory_allocated before it, the largest (GiB)",
        "dtype": args.dtype,
        "gradient_checkpointing": not args.no_checkpointing,
        "grad_accum": args.grad_accum,
        "compile": args.compile,
        "lora_alpha": "= rank (scaling 1)",
        "lora_dropout": args.dropout,
        "init_lora_weights": False,
        "targets": TARGETS,
        "optimizer": "excluded" if "train" not in args.phases else "grad: excluded; train: " + TRAIN_OPTIMIZER,
        "first_ms": "wall time of each row's first step (queue drained around it), the first round's with rounds",
    }
    if args.dynamic is not None:
        protocol["dynamic"] = (
            f"tokens per sequence drawn from {args.dynamic[0]}..{args.dynamic[1]} at each timed step (seed + 3), the "
            "same for every mode, after an untimed forward and backward with the adapters off at that count; each "
            f"timed step also runs every mode at --seq {args.seq} (fixed_times_ms); every call timed by wall clock "
            "with the queue drained around it"
        )
    if "decode" in args.phases:
        protocol["decode"] = (
            f"generate: greedy, batch 1, {args.prompt}-token prompt, exactly {args.new_tokens} new tokens, KV cache "
            "on, adapters unmerged; ms, times_ms and first_ms per generated token"
        )
    result = record.new_result("model", device, protocol, vars(args))
    result["config"] = {
        "name": name,
        **{
            k: getattr(config, k, None)
            for k in (
                "model_type",
                "hidden_size",
                "num_hidden_layers",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        },
    }
    torch.manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    base_row = {
        "preset": name,
        "rank": args.rank,
        "tokens": args.batch * args.seq,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
    }
    records, build_s = [], {}
    with Progress() as bar:
        task = bar.add_task(f"{name}: building", total=args.rounds * len(args.modes) * len(args.phases))
        t0 = time.perf_counter()
        if args.interleave:
            weights = build_weights(config, args, device)
            build_s["base"] = time.perf_counter() - t0
            records = run_interleaved(weights, ids, args, device, base_row, bar, task, name, build_s)
        else:
            model = build_base(config, args, device)
            build_s["base"] = time.perf_counter() - t0
            for k in range(args.rounds):
                label = name + (f", round {k + 1}/{args.rounds}" if args.rounds > 1 else "")
                model, rows = run_round(model, ids, args, device, base_row, bar, task, label, build_s, k % 2 == 1)
                records.append(rows)
            records = pool_rounds(records)
    result["build_s"] = build_s
    result["records"] = records
    paths = record.write(result, args.out, render_markdown, render_png)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
