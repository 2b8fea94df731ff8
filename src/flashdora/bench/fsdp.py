"""``flashdora bench fsdp``: a training step under PyTorch FSDP2 on several GPUs, PEFT LoRA vs PEFT DoRA vs flashdora.

``run(args)`` (the CLI) starts ``--nproc`` ranks with ``torch.distributed.run`` on this module (``worker``), one
launch for every (rank, mode) row, and writes the result JSON and Markdown. Each row builds the model from its config
with random weights on every rank (float32, so that FSDP2 keeps float32 shards), wraps it with PEFT (LoRA or DoRA on
every linear projection, ``lora_alpha = r``, random non-zero ``lora_B``), shards every decoder layer and the root
with ``fully_shard`` (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` unless ``--no-mp``),
enables flashdora for the ``flashdora`` mode, and times ``--warmup`` + ``--reps`` steps: forward, backward, AdamW
step, ``zero_grad``, each rank on its own ``--batch`` sequences of ``--seq`` tokens, gradient checkpointing on unless
``--no-checkpointing``. The first step is reported on its own (``first_s``: Triton compilation and tuning included).
Peak memory is the largest ``max_memory_allocated`` over the ranks.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("peft_lora", "peft_dora", "flashdora")


def run(args) -> int:
    """The CLI: one ``torch.distributed.run`` launch per (rank, mode) row, then the result files."""
    import torch

    from flashdora.bench import record

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    nproc = args.nproc or (torch.cuda.device_count() if device.startswith("cuda") else 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in args.ranks:
            for mode in args.modes:
                out = Path(tmp) / f"{r}-{mode}.json"
                opts = {**_options(args), "rank": r, "mode": mode, "device": device, "out": str(out)}
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m",
                       "flashdora.bench.fsdp", json.dumps(opts)]  # fmt: skip
                print(f"bench fsdp: r={r} {mode} on {nproc} ranks", file=sys.stderr, flush=True)
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                done = subprocess.run(cmd, env=env)
                if done.returncode == 0 and out.is_file():
                    rows.append(json.loads(out.read_text()))
                else:
                    rows.append({"r": r, "mode": mode, "error": f"exit {done.returncode}"})
    protocol = {"ranks": nproc, "mixed_precision": "off" if args.no_mp else "bf16 params, fp32 reduce",
                "checkpointing": not args.no_checkpointing, "optimizer": "AdamW (foreach)"}  # fmt: skip
    result = record.new_result("fsdp", device, protocol, vars(args))
    result["records"] = rows
    paths = record.write(result, args.out, render_markdown, None)
    print(render_markdown(json.loads(paths["json"].read_text())))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) else 1


def _options(args) -> dict:
    keys = ("preset", "layers", "seq", "batch", "reps", "warmup", "no_mp", "no_checkpointing", "seed")
    return {k: getattr(args, k) for k in keys}


def render_markdown(result: dict) -> str:
    from flashdora.bench import record

    recs = result["records"]
    ms = {(r["r"], r["mode"]): r.get("ms") for r in recs}
    rows = []
    for rec in sorted(recs, key=lambda x: (x["r"], MODES.index(x["mode"]))):
        lora, dora, this = ms.get((rec["r"], "peft_lora")), ms.get((rec["r"], "peft_dora")), rec.get("ms")
        rows.append([
            rec.get("preset"), rec["r"], rec["mode"], this,
            None if not (this and lora) else this / lora, None if not (this and dora) else dora / this,
            rec.get("peak_gib"), rec.get("first_s"), rec.get("norms_per_step"), rec.get("error", ""),
        ])  # fmt: skip
    columns = ["preset", "r", "mode", "step ms", "vs peft_lora", "peft_dora / this", "peak GiB per GPU",
               "first step s", "norms per step", "error"]  # fmt: skip
    return record.header(result, "flashdora bench fsdp") + "\n\n" + record.table(columns, rows) + "\n"


def _build(opts: dict, device):
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import flashdora
    from flashdora.bench.model import PRESETS, TARGETS

    cls_name, fields = PRESETS[opts["preset"]]
    config = getattr(transformers, cls_name)(**fields)
    if opts["layers"]:
        config.num_hidden_layers = opts["layers"]
    config.use_cache = False
    torch.manual_seed(opts["seed"])  # the same weights on every rank
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        lora = LoraConfig(r=opts["rank"], lora_alpha=opts["rank"], target_modules=TARGETS,
                          use_dora=opts["mode"] != "peft_lora", init_lora_weights=False)  # fmt: skip
        model = get_peft_model(model, lora)
    if not opts["no_checkpointing"]:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = {} if opts["no_mp"] else {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if opts["mode"] == "flashdora":
        flashdora.enable(model)
    return model


def worker(opts: dict) -> None:
    """One row, on every rank of a ``torch.distributed.run`` launch; rank 0 writes ``opts["out"]``."""
    import torch
    import torch.distributed as dist

    import flashdora

    cuda = opts["device"].startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    model = _build(opts, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(opts["seed"] + rank)
    ids = torch.randint(0, vocab, (opts["batch"], opts["seq"]), generator=g).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(1 + opts["warmup"] + opts["reps"]):
        if i == 1 + opts["warmup"]:
            flashdora.reset_stats()
        dist.barrier()
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    stats = flashdora.stats()
    norms = (stats.get("norm:triton", 0) + stats.get("norm:eager", 0)) / opts["reps"]
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    slowest = torch.tensor(times, device=device)  # a step ends when the slowest rank's does
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest = slowest.tolist()
    if rank == 0:
        row = {
            "preset": opts["preset"] + (f"-{opts['layers']}l" if opts["layers"] else ""),
            "r": opts["rank"], "mode": opts["mode"], "ranks": world, "seq": opts["seq"], "batch": opts["batch"],
            "ms": statistics.median(slowest[1 + opts["warmup"]:]) * 1e3,
            "times_ms": [t * 1e3 for t in slowest[1 + opts["warmup"]:]],
            "first_s": slowest[0], "peak_gib": peak.item() if cuda else None,
            "norms_per_step": norms if opts["mode"] == "flashdora" else None,
            "paths": sorted(k for k in stats if not k.startswith("norm")),
        }  # fmt: skip
        Path(opts["out"]).write_text(json.dumps(row))
    model = opt = None
    gc.collect()  # before the process group (examples/fsdp2_train.py says why)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
