"""``flashdora bench layer``'s kernel sections: device ceilings, the compose and the norm alone, PEFT's norm vs ours,
and the kernels of a training layer call against their limits (``step_kernels``).

The compose forward is read in GB/s against a device-to-device copy, the factored norm in TFLOP/s against a bf16
GEMM, both for the eager twin and (where it can launch) the Triton kernel. Keys: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import sys

import torch
from torch import nn

import flashdora
from flashdora import backend
from flashdora.ops.compose import compose_fwd_eager
from flashdora.ops.norm import norm_sq_eager, scales, weight_sq_eager
from flashdora.tools.bench import record, timing
from flashdora.tools.bench.step_kernels import bench_step_kernels, render_step_kernels


def shape_name(d_in: int, d_out: int) -> str:
    return f"{d_in}x{d_out}"


def timed(fn, *, warmup: int, reps: int, device) -> dict:
    """``{"ms", "peak_extra_mib", "times_ms"}`` of ``fn``; an exception (OOM, a failing kernel) is recorded, printed,
    and the sweep goes on, so one broken row does not cost the run."""
    try:
        m = timing.measure(fn, warmup=warmup, reps=reps, device=device)
    except Exception as e:  # noqa: BLE001 - recorded in the row and printed
        timing.free_memory(device)
        error = timing.describe_error(e)
        print(f"bench: row failed: {error}", file=sys.stderr)
        return {"ms": None, "peak_extra_mib": None, "error": error}
    return {"ms": m.ms, "peak_extra_mib": m.peak_extra_mib, "times_ms": m.times_ms}


def _kernel(module: str, name: str):
    """``flashdora.kernels.<module>.<name>`` when it exists and can launch here, else None."""
    try:
        return getattr(importlib.import_module(f"flashdora.kernels.{module}"), name)
    except (ImportError, AttributeError):
        return None


def _rate(work: float, ms: float | None, unit: float) -> float | None:
    return None if not ms else work / (ms * 1e-3) / unit


def bench_kernels(args, device) -> dict:
    """Device peaks, the compose and the norm alone (eager twin and Triton kernel), PEFT's norm vs ours, and the
    kernels of a training layer call against their limits (where the Triton kernels can launch)."""
    cuda = timing.is_cuda(device)
    launchable = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    kernels = {
        "compose": _kernel("compose", "compose_fwd") if launchable else None,
        "norm": _kernel("norm", "factored_norm_sq") if launchable else None,
    }
    reps = {"warmup": args.warmup, "reps": args.reps, "device": device}
    peaks = {
        "copy_gbps": timing.copy_bandwidth_gbps(device, nbytes=2**30 if cuda else 2**24),
        "bf16_gemm_tflops": timing.gemm_tflops(device, n=8192 if cuda else 256),
    }
    d_outs = list(dict.fromkeys(d for _, d in args.shapes))
    return {
        "device_peaks": peaks,
        "kernels_available": {k: v is not None for k, v in kernels.items()},
        "compose": bench_compose(d_outs, max(args.tokens), kernels["compose"], peaks, reps),
        "norm": bench_norm(args.shapes, args.ranks, kernels["norm"], peaks, reps),
        "norm_compare": compare_norms(*args.norm_shape, args.norm_rank, reps),
        "step_kernels": bench_step_kernels(args.shapes, args.ranks, max(args.tokens), peaks, reps)
        if launchable
        else [],
    }


def bench_compose(d_outs, tokens: int, kernel, peaks: dict, reps: dict) -> list[dict]:
    """The compose forward alone per ``d_out``, eager twin and Triton kernel, with and without ``save_inner``."""
    device, rows = reps["device"], []
    for d_out in d_outs:
        result = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)
        lora = torch.randn_like(result)
        magnitude = torch.rand(d_out, device=device) + 0.5
        g, gm1, _ = scales(magnitude, torch.rand(d_out, device=device) + 0.5)
        for impl, fn in (("eager", compose_fwd_eager), ("triton", kernel)):
            for save_inner in (True, False) if fn is not None else ():
                # bytes moved: every input read once, every output written once
                nbytes = sum(t.nbytes for t in (result, lora, g, gm1)) + result.nbytes * (1 + save_inner)
                rows_g = (g, gm1) if impl == "eager" else (torch.stack([g, gm1]),)  # the kernel takes the scales
                got = timed(functools.partial(fn, result, lora, *rows_g, 1.0, save_inner=save_inner), **reps)
                gbps = _rate(nbytes, got["ms"], 1e9)
                rows.append(
                    {
                        "d_out": d_out,
                        "tokens": tokens,
                        "impl": impl,
                        "save_inner": save_inner,
                        "bytes": nbytes,
                        **got,
                        "gbps": gbps,
                        "of_copy": None if gbps is None else gbps / peaks["copy_gbps"],
                    }
                )
        del result, lora
    return rows


def bench_norm(shapes, ranks, kernel, peaks: dict, reps: dict) -> list[dict]:
    """The factored norm squared alone per (shape, rank): eager chunked path, Triton path, and the Triton path with
    ``||W||^2`` given, as the norm cache gives it for every step after the first on a frozen W."""
    device, rows = reps["device"], []
    for (d_in, d_out), rank in itertools.product(shapes, ranks):
        w = torch.randn(d_out, d_in, device=device, dtype=torch.bfloat16)
        a = torch.randn(rank, d_in, device=device) / d_in**0.5
        b = torch.randn(d_out, rank, device=device)
        w_sq = weight_sq_eager(w)  # what the norm cache keeps per version of a frozen W
        impls = (
            ("eager", functools.partial(norm_sq_eager, w, a, b, 1.0)),
            ("triton", kernel and functools.partial(kernel, w, a, b, 1.0)),
            ("triton, ||W||^2 cached", kernel and functools.partial(kernel, w, a, b, 1.0, w_sq)),
        )
        for impl, fn in impls:
            if fn is not None:
                got = timed(fn, **reps)
                tflops = _rate(2 * d_out * d_in * rank, got["ms"], 1e12)
                rows.append(
                    {
                        "shape": shape_name(d_in, d_out),
                        "rank": rank,
                        "impl": impl,
                        **got,
                        "tflops": tflops,
                        "of_gemm": None if tflops is None else tflops / peaks["bf16_gemm_tflops"],
                    }
                )
        del w, a, b
    return rows


def compare_norms(d_in: int, d_out: int, rank: int, reps: dict) -> list[dict]:
    """PEFT's dense norm (its forward's path under bf16 autocast) vs ``flashdora.factored_norm``: time, memory."""
    from peft.tuners.lora.dora import DoraLinearLayer

    device = reps["device"]
    w = torch.randn(d_out, d_in, device=device, dtype=torch.bfloat16)
    lora_A = nn.Linear(d_in, rank, bias=False, device=device)  # fp32, PEFT's default adapter dtype
    lora_B = nn.Linear(rank, d_out, bias=False, device=device)
    dora = DoraLinearLayer(fan_in_fan_out=False)

    def peft_norm():  # DoraLinearLayer.forward's norm with bf16 activations under autocast
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            lora_weight = dora.get_lora_weight(lora_A=lora_A, lora_B=lora_B).to(torch.bfloat16)
            dora.get_weight_norm(weight=w, lora_weight=lora_weight, scaling=1.0)

    a, b = lora_A.weight.detach(), lora_B.weight.detach()
    impls = {
        "peft_dense": peft_norm,
        "flashdora.factored_norm": lambda: flashdora.factored_norm(w, a, b, 1.0),
        "flashdora_eager": lambda: norm_sq_eager(w, a, b, 1.0).sqrt_(),
    }
    rows = []
    for impl, fn in impls.items():
        timing.free_memory(device)
        flashdora.reset_stats()
        got = timed(fn, **reps)
        rows.append(
            {"shape": shape_name(d_in, d_out), "rank": rank, "impl": impl, "paths": sorted(backend.stats()), **got}
        )
    return rows


def render_kernels(result: dict) -> list[str]:
    """Markdown for the kernel sections of a layer result (empty when the run skipped them)."""
    if "device_peaks" not in result:
        return []
    p = result["device_peaks"]
    compose = [
        [c["d_out"], c["tokens"], c["impl"], c["save_inner"], c["bytes"] / 2**20, c["ms"], c["gbps"], c["of_copy"]]
        for c in result["compose"]
    ]
    norm = [
        [n["shape"], n["rank"], n["impl"], n["ms"], n["tflops"], n["of_gemm"], n["peak_extra_mib"]]
        for n in result["norm"]
    ]
    compare = [
        [n["shape"], n["rank"], n["impl"], " ".join(n["paths"]) or "-", n["ms"], n["peak_extra_mib"]]
        for n in result["norm_compare"]
    ]
    return [
        "",
        "## Kernels alone",
        "",
        f"Device, same run: copy {p['copy_gbps']:.0f} GB/s (device-to-device, read + write), "
        f"bf16 GEMM {p['bf16_gemm_tflops']:.3g} TFLOP/s (8192^3 on GPU). "
        f"Triton kernels present: {result['kernels_available']}.",
        "",
        "Compose forward (bytes read + written; `inner` saved for backward when save_inner):",
        "",
        record.table(["d_out", "tokens", "impl", "save_inner", "MiB moved", "ms", "GB/s", "of copy"], compose),
        "",
        "Factored norm squared (bf16 weight, fp32 adapters; 2 d_out d_in r FLOPs):",
        "",
        record.table(["shape", "r", "impl", "ms", "TFLOP/s", "of GEMM", "peak extra MiB"], norm),
        "",
        "PEFT's norm (dense W + s B A, its forward's path under bf16 autocast) vs flashdora:",
        "",
        record.table(["shape", "r", "impl", "paths", "ms", "peak extra MiB"], compare),
        *render_step_kernels(result),
    ]
