"""``flashdora bench model``: a whole model from a transformers config, random weights, base vs LoRA vs DoRA.

The base model is built once (bf16, gradient checkpointing on) and wrapped in turn: PEFT LoRA (then unloaded),
PEFT DoRA (timed as ``peft_dora`` after ``flashdora.disable``, as ``flashdora`` after ``flashdora.enable`` and as
``flashdora_nocache`` after ``flashdora.enable(norm_cache=False)``, then unloaded). Each timed ``grad`` step first
marks the trainable parameters as changed (``increment_version``, as an optimizer step would), so flashdora's norm
cache recomputes the norm once per step, as in real training; ``inference`` keeps the cache (weights are fixed).
Adapters target every linear projection, ``lora_alpha = rank``, no dropout, ``init_lora_weights=False`` (random
non-zero ``lora_B``), the same seed before each wrap. Protocol and result keys: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

import flashdora
from flashdora.bench import record, timing
from flashdora.bench.model_render import MODES, PHASES, render_markdown, render_png

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_LLAMA, _QWEN2 = "LlamaConfig", "Qwen2Config"
# name -> (transformers config class, fields); random weights, so only the shapes matter.
PRESETS = {
    "tiny": (
        _LLAMA,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
    ),
    "llama3-8b": (
        _LLAMA,
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
        ),
    ),
    "qwen2-7b": (
        _QWEN2,
        dict(
            hidden_size=3584,
            num_hidden_layers=28,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
        ),
    ),
    "qwen2.5-32b": (
        _QWEN2,
        dict(
            hidden_size=5120,
            num_hidden_layers=64,
            intermediate_size=27648,
            num_attention_heads=40,
            num_key_value_heads=8,
            vocab_size=152064,
        ),
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b", help="default: %(default)s")
    parser.add_argument("--config", type=Path, help="a transformers config.json instead of a preset")
    parser.add_argument("--layers", type=int, help="override the number of decoder layers")
    parser.add_argument("--rank", type=int, default=384, help="LoRA rank; lora_alpha = rank (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--phases",
        nargs="+",
        choices=PHASES,
        default=list(PHASES),
        help="inference: forward without grad; grad: forward + backward, no optimizer step",
    )
    parser.add_argument(
        "--dtype",
        choices=("autocast", "bf16"),
        default="autocast",
        help="autocast: bf16 model, fp32 adapters (PEFT's default), bf16 autocast; bf16: all bf16",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5, help="timed steps per row and round; the median is reported")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the whole sequence of modes this many times, every second round in reverse order, and pool "
        "each row's timed steps, so that a host that speeds up or slows down during the run, or a position in the "
        "order, weighs on every mode alike (eager only)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per timed grad step")
    parser.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    parser.add_argument("--compile", action="store_true", help="torch.compile each mode's model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results", help="result folder (default: %(default)s)")
    parser.add_argument("--tag", default=None, help="suffix for the result file names, e.g. accum4")


def build_config(args) -> tuple[str, transformers.PretrainedConfig]:
    """(preset name, config): ``--config`` file or a preset, with ``--layers`` applied."""
    if args.config is not None:
        name = args.config.stem
        config = transformers.AutoConfig.for_model(**json.loads(args.config.read_text()))
    else:
        name = args.preset
        cls_name, fields = PRESETS[name]
        config = getattr(transformers, cls_name)(**fields)
    if args.layers is not None:
        config.num_hidden_layers = args.layers
        name = f"{name}-{args.layers}l"
    config.use_cache = False
    return name, config


def build_base(config, args, device) -> torch.nn.Module:
    """The frozen bf16 model on ``device``, gradient checkpointing on, input embeddings requiring grad.

    The embedding hook lets ``base`` run a backward (activation gradients only), the floor under LoRA.
    """
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.requires_grad_(False)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


def wrap(model, args, use_dora: bool):
    """``model`` with PEFT adapters on every linear projection (fp32 under ``--dtype autocast``)."""
    torch.manual_seed(args.seed + 1)  # the same A and B values for LoRA and DoRA
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=0.0,
        target_modules=TARGETS,
        use_dora=use_dora,
        init_lora_weights=False,
    )
    with torch.device(model.device):  # adapters initialised where they live, not on the CPU first
        return get_peft_model(model, config, autocast_adapter_dtype=args.dtype == "autocast")


def step_fn(model, ids, phase: str, args):
    """One timed step: a forward without grad, or ``--grad-accum`` forward+backward passes, ``.grad`` dropped after."""
    device_type = ids.device.type
    call = torch.compile(model) if args.compile else model

    def amp():
        return (
            torch.autocast(device_type, dtype=torch.bfloat16) if args.dtype == "autocast" else contextlib.nullcontext()
        )

    if phase == "inference":
        model.eval()

        def inference():
            with torch.no_grad(), amp():
                call(input_ids=ids)

        return inference
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def grad():
        torch.autograd.graph.increment_version(params)  # what an optimizer step does to the weights' versions
        for _ in range(args.grad_accum):
            with amp():
                loss = call(input_ids=ids, labels=ids).loss / args.grad_accum
            loss.backward()
        for p in params:  # dropped after each step: the baseline excludes gradients, the peak includes them
            p.grad = None

    return grad


def measure_mode(target, mode, ids, args, device, base_row, bar, task, label) -> list[dict]:
    """Every phase of one built mode."""
    rows = []
    for phase in args.phases:
        bar.update(task, description=f"{label}: {mode} {phase}")
        timing.free_memory(device)
        flashdora.reset_stats()
        row = {**base_row, "mode": mode, "phase": phase}
        try:
            m = timing.measure(step_fn(target, ids, phase, args), warmup=args.warmup, reps=args.reps, device=device)
            row.update(
                ms=m.ms,
                peak_extra_gib=m.peak_extra_gib,
                times_ms=m.times_ms,
                warmup_s=m.warmup_s,
                tokens_per_s=row["tokens"] * (args.grad_accum if phase == "grad" else 1) / (m.ms * 1e-3),
            )
        except Exception as e:  # noqa: BLE001 - recorded in the row and printed; the other modes still run
            timing.free_memory(device)
            error = "out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {e}"[:300]
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
    groups = [(False, ["peft_lora"]), (True, ["peft_dora", "flashdora", "flashdora_nocache"])]
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
            if mode == "peft_dora":
                flashdora.disable(peft_model)
            else:
                flashdora.enable(peft_model, norm_cache=mode == "flashdora")
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
            row["tokens_per_s"] = row["tokens_per_s"] * same[0]["ms"] / row["ms"]
        pooled.append(row)
    return pooled


def run(args) -> int:
    from rich.progress import Progress

    device = torch.device(args.device)
    for flag in ("rank", "batch", "seq", "reps", "rounds", "grad_accum"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"bench model: --{flag.replace('_', '-')} expected >= 1, got {getattr(args, flag)}")
    if args.rounds > 1 and args.compile:
        raise SystemExit("bench model: --rounds > 1 with --compile would recompile every mode in every round; use 1")
    name, config = build_config(args)
    protocol = {
        "warmup": args.warmup,
        "reps": args.reps,
        "rounds": args.rounds,
        "statistic": "median" if args.rounds == 1 else "median of all rounds' timed steps (round_ms: each round's)",
        "order": "as listed" if args.rounds == 1 else "alternating: every second round runs the modes reversed",
        "timer": "cuda events" if timing.is_cuda(device) else "perf_counter",
        "memory": "max_memory_allocated over the timed steps minus memory_allocated before them (GiB)",
        "dtype": args.dtype,
        "gradient_checkpointing": not args.no_checkpointing,
        "grad_accum": args.grad_accum,
        "compile": args.compile,
        "lora_alpha": "= rank (scaling 1)",
        "lora_dropout": 0.0,
        "init_lora_weights": False,
        "targets": TARGETS,
        "optimizer": "excluded",
    }
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
        model = build_base(config, args, device)
        build_s["base"] = time.perf_counter() - t0
        for k in range(args.rounds):
            label = name + (f", round {k + 1}/{args.rounds}" if args.rounds > 1 else "")
            model, rows = run_round(model, ids, args, device, base_row, bar, task, label, build_s, reverse=k % 2 == 1)
            records.append(rows)
    records = pool_rounds(records)
    result["build_s"] = build_s
    result["records"] = records
    paths = record.write(result, args.out, render_markdown, render_png)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
