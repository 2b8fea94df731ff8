"""``flashdora bench model``: a whole model from a transformers config, random weights, base vs LoRA vs DoRA.

The base model is built once (bf16, gradient checkpointing on) and wrapped in turn: PEFT LoRA (then unloaded),
PEFT DoRA (timed as ``peft_dora`` after ``flashdora.disable``, as ``flashdora`` after ``flashdora.enable``, as
``flashdora_python`` as ``flashdora`` with ``FLASHDORA_NATIVE=0`` (the Python compose, for an A/B of the C++ one in
one launch), as ``flashdora_nocache`` after ``flashdora.enable(norm_cache=False)`` and as ``flashdora_adapter`` after
``flashdora.enable(dropout="adapter")``, then unloaded). Phases (``inference``, ``grad``,
``train``, ``decode``) and what each step does: bench/model_phases.py. ``grad`` and ``train`` change (or mark as
changed) the weights every step, so flashdora's norm cache recomputes the norm once per step, as in real training;
``inference`` and ``decode`` keep the cache (weights are fixed). ``train`` really updates the adapters (AdamW,
lr 1e-5), so the modes after it on the same PEFT model start from slightly different values.
Adapters target every linear projection, ``lora_alpha = rank``, ``lora_dropout = --dropout`` (default 0),
``init_lora_weights=False`` (random non-zero ``lora_B``), the same seed before each wrap. Protocol and result keys:
docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model

import flashdora
from flashdora import config
from flashdora.bench import record, timing
from flashdora.bench.model_phases import TRAIN_OPTIMIZER, first_call_timed, step_fn
from flashdora.bench.model_render import MODES, PHASES, render_markdown, render_png  # noqa: F401 - for callers

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
    "llama3-70b": (
        _LLAMA,
        dict(
            hidden_size=8192,
            num_hidden_layers=80,
            intermediate_size=28672,
            num_attention_heads=64,
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


def default_rank(config) -> int:
    """A rank that fits the shapes: a quarter of the hidden size, at most 384 (the 8B headline's rank)."""
    return max(1, min(384, config.hidden_size // 4))


def build_base(config, args, device) -> torch.nn.Module:
    """The frozen bf16 model on ``device`` (``--quant``: its projections quantized), ready to wrap (``prepare``)."""
    return prepare(build_weights(config, args, device), args)


def build_weights(config, args, device) -> torch.nn.Module:
    """The bf16 model from ``config`` on ``device``, seeded, its projections quantized under ``--quant``."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if getattr(args, "quant", "none") != "none":
        quantize(model, args.quant, device)
    return model


def prepare(model, args) -> torch.nn.Module:
    """``model`` frozen, gradient checkpointing on (unless ``--no-checkpointing``), input embeddings requiring grad.

    The embedding hook lets ``base`` run a backward (activation gradients only), the floor under LoRA.
    """
    model.requires_grad_(False)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


def quantize(model, kind: str, device) -> None:
    """Every targeted projection replaced by a bitsandbytes layer holding its weights (``nf4``: ``Linear4bit``,
    bf16 compute; ``int8``: ``Linear8bitLt``), quantized as bitsandbytes does when a layer moves to the GPU."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in TARGETS or type(child) is not torch.nn.Linear:
                continue
            weight = child.weight.data.cpu()  # (bitsandbytes quantizes on the move from the CPU)
            if kind == "nf4":
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")  # fmt: skip
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                            has_fp16_weights=False, device="meta")  # fmt: skip
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data.cpu(), requires_grad=False)
            setattr(parent, name, layer.to(device))
            del child, weight


def wrap(model, args, use_dora: bool):
    """``model`` with PEFT adapters on every linear projection (fp32 under ``--dtype autocast``)."""
    torch.manual_seed(args.seed + 1)  # the same A and B values for LoRA and DoRA
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=args.dropout,
        target_modules=TARGETS,
        use_dora=use_dora,
        init_lora_weights=False,
    )
    with torch.device(model.device):  # adapters initialised where they live, not on the CPU first
        return get_peft_model(model, config, autocast_adapter_dtype=args.dtype == "autocast")


def phase_row(target, base_row, mode, phase, args) -> dict:
    """The fields of one (mode, phase) row known before it runs: decode's own sizes, train's optimizer size."""
    row = {**base_row, "mode": mode, "phase": phase}
    if phase == "decode":  # batch 1; ``tokens``: generated per step
        row.update(tokens=args.new_tokens, batch=1, seq=args.prompt, prompt=args.prompt, new_tokens=args.new_tokens)
    elif phase == "train":  # 0 for ``base``: no trainable parameters, no optimizer step
        row["optimizer_params"] = sum(p.numel() for p in target.parameters() if p.requires_grad)
    return row


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
    dora_modes = ["peft_dora", "flashdora", "flashdora_python", "flashdora_nocache", "flashdora_adapter"]
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
            with _native_off(mode == "flashdora_python"):
                rows += measure_mode(peft_model, mode, ids, args, device, base_row, bar, task, label)
        model = peft_model.unload()
        del peft_model
        timing.free_memory(device)
    return model, rows


def _native_off(off: bool):
    """``configure(native=False)`` inside (``off``), the caller's setting restored after."""
    return config.override(native=False) if off else contextlib.nullcontext()


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
        pooled.append(row)
    return pooled


def _order(args) -> str:
    if args.interleave:
        from flashdora.bench.model_interleave import ORDER

        return ORDER
    return "as listed" if args.rounds == 1 else "alternating: every second round runs the modes reversed"


def run(args) -> int:
    from rich.progress import Progress

    device = torch.device(args.device)  # options checked by flashdora.cli.check
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
            from flashdora.bench.model_interleave import run_interleaved

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
