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

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = ("base", "peft_lora", "peft_dora", "flashdora", "flashdora_nocache")
PHASES = ("inference", "grad")
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
    parser.add_argument("--reps", type=int, default=5, help="timed steps per row; the median is reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per timed grad step")
    parser.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    parser.add_argument("--compile", action="store_true", help="torch.compile each mode's model (experimental)")
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


def measure_mode(target, mode, ids, args, device, base_row, bar, task) -> list[dict]:
    """Every phase of one built mode."""
    rows = []
    for phase in args.phases:
        bar.update(task, description=f"{base_row['preset']}: {mode} {phase}")
        timing.free_memory(device)
        flashdora.reset_stats()
        row = {**base_row, "mode": mode, "phase": phase}
        try:
            m = timing.measure(step_fn(target, ids, phase, args), warmup=args.warmup, reps=args.reps, device=device)
            row.update(
                ms=m.ms,
                peak_extra_gib=m.peak_extra_gib,
                times_ms=m.times_ms,
                tokens_per_s=row["tokens"] * (args.grad_accum if phase == "grad" else 1) / (m.ms * 1e-3),
            )
        except Exception as e:  # noqa: BLE001 - recorded in the row and printed; the other modes still run
            timing.free_memory(device)
            error = "out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {e}"[:300]
            print(f"bench model: {mode} {phase} failed: {error}", file=sys.stderr)
            row.update(ms=None, peak_extra_gib=None, error=error)
        row["paths"] = sorted(k for k in flashdora.stats() if not k.startswith("norm"))
        rows.append(row)
        bar.advance(task)
    return rows


def run(args) -> int:
    from rich.progress import Progress

    device = torch.device(args.device)
    for flag in ("rank", "batch", "seq", "reps", "grad_accum"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"bench model: --{flag.replace('_', '-')} expected >= 1, got {getattr(args, flag)}")
    name, config = build_config(args)
    protocol = {
        "warmup": args.warmup,
        "reps": args.reps,
        "statistic": "median",
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
        task = bar.add_task(f"{name}: building", total=len(args.modes) * len(args.phases))
        t0 = time.perf_counter()
        model = build_base(config, args, device)
        build_s["base"] = time.perf_counter() - t0
        if "base" in args.modes:
            records += measure_mode(model, "base", ids, args, device, base_row, bar, task)
        dora_modes = ["peft_dora", "flashdora", "flashdora_nocache"]
        for use_dora, modes in ((False, ["peft_lora"]), (True, dora_modes)):
            modes = [m for m in modes if m in args.modes]
            if not modes:
                continue
            bar.update(task, description=f"{name}: wrapping for {'DoRA' if use_dora else 'LoRA'}")
            t0 = time.perf_counter()
            peft_model = wrap(model, args, use_dora)
            build_s["peft_dora" if use_dora else "peft_lora"] = time.perf_counter() - t0
            for mode in modes:
                if mode == "peft_dora":
                    flashdora.disable(peft_model)
                else:
                    flashdora.enable(peft_model, norm_cache=mode == "flashdora")
                records += measure_mode(peft_model, mode, ids, args, device, base_row, bar, task)
            model = peft_model.unload()
            del peft_model
            timing.free_memory(device)
    result["build_s"] = build_s
    result["records"] = records
    paths = record.write(result, args.out, render_markdown, render_png)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def render_markdown(result: dict) -> str:
    """The model table, from a result JSON: time, throughput, ratios and memory per (mode, phase)."""
    recs = result["records"]
    ms = {(r["preset"], r["phase"], r["mode"]): r["ms"] for r in recs}

    def ratio(r, mode):
        other = ms.get((r["preset"], r["phase"], mode))
        return None if r["ms"] is None or not other else r["ms"] / other

    columns = [
        "preset",
        "phase",
        "mode",
        "r",
        "tokens",
        "ms",
        "tokens/s",
        "vs base",
        "vs peft_lora",
        "peft_dora / this",
        "peak extra GiB",
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
                r.get("tokens_per_s"),
                ratio(r, "base"),
                ratio(r, "peft_lora"),
                None if not r["ms"] or dora is None else dora / r["ms"],
                r["peak_extra_gib"],
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
                "ms: median per step (grad: forward + backward, optimizer excluded); peak extra GiB: "
                "above the resident model and adapters.",
                "",
                record.table(columns, rows),
            ]
        )
        + "\n"
    )


def render_png(result: dict, path) -> None:
    """Time and peak extra memory per mode, one bar group per phase."""
    recs = result["records"]
    phases = [p for p in PHASES if any(r["phase"] == p for r in recs)]
    modes = [m for m in MODES if any(r["mode"] == m for r in recs)]
    look = {(r["phase"], r["mode"]): r for r in recs}
    fig, axes = record.figure(1, 2, (11, 4))
    for ax, (field, label) in zip(axes[0], [("ms", "ms per step"), ("peak_extra_gib", "peak extra GiB")], strict=True):
        series = {m: [look.get((p, m), {}).get(field) for p in phases] for m in modes}
        record.grouped_bars(ax, phases, series, label)
        ax.set_title(f"{result['config']['name']}, r={recs[0]['rank'] if recs else '-'}: {label}", fontsize=9)
        if any(v is not None for vals in series.values() for v in vals):
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured on this device", ha="center", transform=ax.transAxes)
    record.save(fig, path)
