"""``flashdora bench fsdp``: a training step under PyTorch FSDP2 on several GPUs, PEFT LoRA vs PEFT DoRA vs flashdora.

``run(args)`` (the CLI) starts ``--nproc`` ranks with ``torch.distributed.run`` on this module (``worker``), one launch
for every (rank, mode) row (``--interleave``: one for every rank, holding a model per mode, each timed step running
every mode once in a rotated order, so that the modes share the host's drifts), and writes the result JSON and
Markdown. Each row builds the model from its config with random weights on every rank (float32, so that FSDP2 keeps
float32 shards), wraps it with PEFT (LoRA or DoRA on every linear projection, ``lora_alpha = r``, a random non-zero
``lora_B``, or PEFT's zero one with ``--lora-init peft``), shards every decoder layer and the root with ``fully_shard``
(``--mp bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; ``off``: none; ``both``: each row
twice), enables flashdora for the ``flashdora`` mode, and times ``--warmup`` + ``--reps`` steps: forward, backward,
AdamW step (``--lr``), ``zero_grad``, each rank on its own ``--batch`` sequences of ``--seq`` tokens, gradient
checkpointing on unless ``--no-checkpointing``. ``--meta`` builds on the meta device instead (a bfloat16 base, float32
adapters, autocast with ``--mp off``), shards, and fills each rank's shards with random values (the magnitude with the
rows' norms of ``W``): for models too large for one GPU. The first step is reported on its own (``first_s``: Triton
compilation and tuning included). Peak memory is the largest ``max_memory_allocated`` over the ranks (with
``--interleave``, the largest of each mode's steps above what the step started with). Every step's loss (the ranks'
mean) is kept in ``losses``; with several steps the PNG plots them per row, and with ``--mp both`` each row's gap to
PEFT DoRA's loss without a policy (what bf16 parameters do to each mode's training; the Markdown gives the largest and
the last gap). The result files are rewritten after every row, and a launch past ``--row-timeout`` is stopped and
recorded as an error.
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

from flashdora.tools.bench.fsdp_render import MODES, render_markdown, render_png  # noqa: F401 - for callers


def run(args) -> int:
    """The CLI: one ``torch.distributed.run`` launch per (rank, mode) row, then the result files."""
    import torch

    from flashdora.tools.bench import record

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    nproc = args.nproc or (torch.cuda.device_count() if device.startswith("cuda") else 2)
    protocol = {"ranks": nproc, "mixed_precision": {"bf16": "bf16 params, fp32 reduce", "off": "off",
                "both": "each row with bf16 params (fp32 reduce) and without"}[args.mp],
                "checkpointing": not args.no_checkpointing, "optimizer": f"AdamW (foreach), lr {args.lr:g}",
                "lora_B": "zero (PEFT's default)" if args.lora_init == "peft" else "random",
                "init": "meta device, then random shards (bf16 base, fp32 adapters)" if args.meta
                else "float32 model on every rank, then sharded", "row_timeout_s": args.row_timeout,
                "order": "interleaved: one launch holding a model per mode, each timed step runs every mode once, "
                "the order rotated step by step; peak memory above what each step started with" if args.interleave
                else "a launch per mode"}  # fmt: skip
    result = record.new_result("fsdp", device, protocol, vars(args))
    result["records"] = rows = []
    paths = record.write(result, args.out, render_markdown, render_png)  # rewritten after every row (below)
    mps = ("bf16", "off") if args.mp == "both" else (args.mp,)
    with tempfile.TemporaryDirectory() as tmp:
        for r in args.ranks:
            for mp in mps:
                for modes in [args.modes] if args.interleave else [[mode] for mode in args.modes]:
                    out = Path(tmp) / f"{r}-{mp}-{'-'.join(modes)}.json"
                    opts = {**_options(args), "rank": r, "modes": modes, "mp": mp, "device": device, "out": str(out)}
                    print(f"bench fsdp: r={r} {' '.join(modes)} (mp {mp}) on {nproc} ranks", file=sys.stderr,
                          flush=True)  # fmt: skip
                    error = _launch(nproc, opts, args.row_timeout)
                    if error is None and out.is_file():
                        rows.extend(json.loads(out.read_text()))
                    else:
                        rows.extend({"r": r, "mode": mode, "mp": mp, "error": error or "no result"} for mode in modes)
                    _rewrite(paths, result)  # a run stopped midway keeps the rows it finished
    print(render_markdown(json.loads(paths["json"].read_text())))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) else 1


def _launch(nproc: int, opts: dict, timeout: float) -> str | None:
    """One ``torch.distributed.run`` launch of ``worker``: ``None``, or why it gave no result (its exit status, or
    ``timeout`` after ``timeout`` seconds). A launch past its time gets SIGTERM, on which torchrun stops its ranks
    (they run in sessions of their own, out of reach of a process-group kill), then SIGKILL if it is still there a
    minute later; Ctrl-C reaches torchrun with the terminal's process group, and this waits for it to clean up."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m",
           "flashdora.tools.bench.fsdp", json.dumps(opts)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        print(f"bench fsdp: the launch ran past --row-timeout {timeout:g} s and was stopped", file=sys.stderr)
        return f"timeout after {timeout:g} s"
    except BaseException:  # Ctrl-C: torchrun got the signal too; let it stop its ranks
        _stop(proc)
        raise
    return None if code == 0 else f"exit {code}"


def _stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _rewrite(paths: dict, result: dict) -> None:
    """The result JSON replaced in one step (a run killed mid-write keeps the previous rows), then its renders."""
    from flashdora.tools.bench import record

    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, paths["json"])
    paths.update(record.render(paths["json"], render_markdown, render_png))


def _options(args) -> dict:
    keys = ("preset", "layers", "seq", "batch", "reps", "warmup", "no_checkpointing", "seed", "lr", "meta")
    return {k: getattr(args, k) for k in (*keys, "lora_init")}


def _fill_shards(model, seed: int, lora_init: str = "random") -> None:
    """Random values in each rank's shards after ``to_empty`` (``--meta``): weights ``N(0, 0.02)``, ``lora_A``
    ``N(0, 1/d_in)``, ``lora_B`` ``N(0, 0.01)`` (``lora_init="peft"``: zero), norm weights 1, each magnitude the
    norms of its ``W`` rows (FSDP2 shards ``W`` and the magnitude by the same rows)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = local(p)
            if "lora_magnitude_vector" in name:
                continue
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif "lora_A" in name:
                t.normal_(0.0, p.shape[1] ** -0.5, generator=g)
            elif "lora_B" in name and lora_init == "peft":
                t.zero_()
            elif "lora_B" in name:
                t.normal_(0.0, 0.01, generator=g)
            else:
                t.normal_(0.0, 0.02, generator=g)
        for module in model.modules():
            mags = getattr(module, "lora_magnitude_vector", None)
            if mags:
                w = local(module.get_base_layer().weight)
                for mag in mags.values():
                    local(mag.weight).copy_(torch.linalg.vector_norm(w.float(), dim=1))
    for module in model.modules():  # buffers (rotary frequencies): from a fresh module built on the CPU
        bufs = dict(module.named_buffers(recurse=False))
        if bufs and hasattr(module, "config"):
            fresh = dict(type(module)(module.config).named_buffers(recurse=False))
            with torch.no_grad():
                for name, buf in bufs.items():
                    buf.copy_(fresh[name])


def _build(opts: dict, device):
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import flashdora
    from flashdora.tools.bench.model_build import PRESETS, TARGETS

    cls_name, fields = PRESETS[opts["preset"]]
    config = getattr(transformers, cls_name)(**fields)
    if opts["layers"]:
        config.num_hidden_layers = opts["layers"]
    config.use_cache = False
    torch.manual_seed(opts["seed"])  # the same weights on every rank
    meta, lora_init = opts.get("meta", False), opts.get("lora_init", "random")
    with torch.device("meta" if meta else device):
        dtype = torch.bfloat16 if meta else torch.float32
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        lora = LoraConfig(r=opts["rank"], lora_alpha=opts["rank"], target_modules=TARGETS,
                          use_dora=opts["mode"] != "peft_lora",
                          init_lora_weights=lora_init == "peft")  # fmt: skip
        model = get_peft_model(model, lora)  # (float32 adapters on a bfloat16 base: PEFT's autocast_adapter_dtype)
    if not opts["no_checkpointing"]:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = opts.get("mp", "bf16")
    kwargs = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if mp == "bf16" else {}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if meta:
        model.to_empty(device=device)
        _fill_shards(model, opts["seed"] + 7919 * int(os.environ.get("RANK", 0)), lora_init)
    if opts["mode"] == "flashdora":
        flashdora.enable(model)
    return model


def worker(opts: dict) -> None:
    """One launch, on every rank of a ``torch.distributed.run``: a row per mode in ``opts["modes"]`` (several:
    ``--interleave``, each timed step running every mode once, the order rotated), written by rank 0 to
    ``opts["out"]``."""
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

    modes = opts["modes"]
    built = {}  # a model and an optimizer per mode, all resident with --interleave
    for mode in modes:
        model = _build({**opts, "mode": mode}, device)
        built[mode] = model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts["lr"])
    if cuda and "flashdora" in modes:
        from flashdora import native

        native.load()  # loaded before the steps (the parent process built it), as in the model bench
    vocab = built[modes[0]][0].config.vocab_size
    g = torch.Generator().manual_seed(opts["seed"] + rank)
    ids = torch.randint(0, vocab, (opts["batch"], opts["seq"]), generator=g).to(device)
    autocast = opts.get("mp", "bf16") == "off" and opts.get("meta", False)  # a bf16 base with fp32 adapters
    losses = {mode: [] for mode in modes}
    times = {mode: [] for mode in modes}
    extra = {mode: 0.0 for mode in modes}  # (several modes: each step's peak above what was allocated before it)

    def step(mode):
        model, opt = built[mode]
        dist.barrier()
        sync()
        if cuda and len(modes) > 1:  # (one mode: the peak over every step, the first included)
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times[mode].append(time.perf_counter() - start)
        losses[mode].append(loss.detach())
        if cuda:
            extra[mode] = max(extra[mode], (torch.cuda.max_memory_allocated() - before) / 2**30)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(1 + opts["warmup"] + opts["reps"]):
        if i == 1 + opts["warmup"]:
            flashdora.reset_stats()
            extra = dict.fromkeys(modes, 0.0)
        for k in range(len(modes)):
            step(modes[(i + k) % len(modes)])
    stats = flashdora.stats()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    rows = []
    for mode in modes:
        slowest = torch.tensor(times[mode], device=device)  # a step ends when the slowest rank's does
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        slowest = slowest.tolist()
        mean_losses = torch.stack(losses[mode]).float()
        dist.all_reduce(mean_losses)
        mean_losses = (mean_losses / world).tolist()
        mode_extra = torch.tensor([extra[mode]], device=device)
        dist.all_reduce(mode_extra, op=dist.ReduceOp.MAX)
        rows.append({
            "preset": opts["preset"] + (f"-{opts['layers']}l" if opts["layers"] else ""),
            "r": opts["rank"], "mode": mode, "mp": opts.get("mp", "bf16"), "ranks": world,
            "seq": opts["seq"], "batch": opts["batch"], "losses": mean_losses,
            "ms": statistics.median(slowest[1 + opts["warmup"]:]) * 1e3,
            "times_ms": [t * 1e3 for t in slowest[1 + opts["warmup"]:]],
            "first_s": slowest[0], "peak_gib": peak.item() if cuda and len(modes) == 1 else None,
            "peak_extra_gib": mode_extra.item() if cuda and len(modes) > 1 else None,
            "norms_per_step": (stats.get("norm:triton", 0) + stats.get("norm:eager", 0)) / opts["reps"]
            if mode == "flashdora" else None,
            "paths": sorted(k for k in stats if not k.startswith("norm")) if mode == "flashdora" else [],
        })  # fmt: skip
    if rank == 0:
        Path(opts["out"]).write_text(json.dumps(rows))
    built = None
    gc.collect()  # before the process group (examples/fsdp2_train.py says why)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
