"""``flashdora bench layer``'s roofline section: flashdora's own kernels of a training layer call against their limits
(the base layer's GEMM and the LoRA matmuls, which ATen runs, are not in it).

For each (shape, rank) at the largest token count, with bf16 activations and float32 adapters (the autocast mode):

- ``compose_fwd``: what a training layer call's compose launches (``ops.compose_fn._fwd``): ``lora_B`` cast to bf16
  first where ``cast_b_first`` says so, then ``_compose_fused_fwd_kernel`` with ``inner`` saved;
- ``compose_bwd``: ``compose_bwd`` with ``inner`` (the magnitude's gradient, its partial sums added);
- ``norm_miss``: a norm-cache miss on a 16-bit weight whose ``||W||^2`` is known (every step after the first):
  ``kernels.norm.norm_and_scales``.

Each is timed by its GPU kernel time (the sum of its kernels' device time under ``torch.profiler``, per call, after
at least one unprofiled call), so that the host's launch time, which the whole-model benches see, does not hide how
near the kernels are to the device. The limit of a call is ``max(bytes / copy rate, FLOPs / bf16 GEMM rate)`` at the
rates measured in the same run (``device_peaks``); its bytes are the least any implementation must move (each input
it needs read once, each output written once), its FLOPs the matmuls' ``2 m n k``. ``of_limit`` = limit / time. A
(shape, rank) that fails (out of memory, a failing kernel) gets rows with ``ms`` null and an ``error``, printed, and
the sweep goes on. Off CUDA the time is the wall time of a call (the code runs; the numbers mean nothing) and no
kernel is listed.
"""

from __future__ import annotations

import sys

import torch

from flashdora.ops.norm import scales, weight_sq_eager
from flashdora.tools.bench import record, timing
from flashdora.tools.bench.host import kernel_ms

KERNELS = ("compose_fwd", "compose_bwd", "norm_miss")


def gpu_ms(fn, *, warmup: int, reps: int, device) -> tuple[float, dict[str, float]]:
    """``(ms per call, {kernel name: ms per call})``: on CUDA the device time of ``fn``'s kernels per call, from one
    profiled run of ``reps`` calls after ``warmup`` (at least one: compiles, the norm's cross-term layout timing)
    unprofiled ones (``host.kernel_ms``); elsewhere the median wall time of a call, and no kernels."""
    for _ in range(max(1, warmup)):
        fn()
    if not timing.is_cuda(device):
        return timing.measure(fn, warmup=0, reps=reps, device=device).ms, {}

    def calls():  # each call's outputs freed before the next
        for _ in range(reps):
            fn()

    by_name: dict[str, float] = {}
    ms = kernel_ms(calls, device, by_name)
    short: dict[str, float] = {}
    for name, t in by_name.items():  # names cut at 60 characters: kernels alike but for template arguments add up
        key = name.split("(")[0][:60]
        short[key] = short.get(key, 0.0) + t / reps
    return ms / reps, dict(sorted(short.items(), key=lambda kv: -kv[1]))


def _work(kernel: str, t: int, d_in: int, n: int, r: int) -> tuple[int, int]:
    """``(bytes, FLOPs)`` the least a call must move and compute, whatever runs it (no cast copy of ``lora_B``, no
    partial sums): bf16 activations and weight, float32 adapters and scale rows."""
    act = t * n * 2  # one bf16 [t, n] tensor
    if kernel == "compose_fwd":  # result, a = x A^T, lora_B, the rows g and g - 1 -> y, inner
        return act + t * r * 2 + n * r * 4 + 2 * n * 4 + 2 * act, 2 * t * n * r
    if kernel == "compose_bwd":  # dy, inner, the rows g and 1 / norm -> g dy, the magnitude's gradient
        return 3 * act + 2 * n * 4 + n * 4, 0
    # norm_miss: W, lora_A, lora_B, ||W||^2, m -> norm and the three scale rows; W A^T, A A^T and B G
    return n * d_in * 2 + r * d_in * 4 + n * r * 4 + 2 * n * 4 + 4 * n * 4, 2 * n * d_in * r + 2 * r * r * (d_in + n)


def _calls(d_in: int, n: int, r: int, tokens: int, device) -> tuple[dict, bool]:
    """``({kernel: call}, cast_b_first)`` for one (shape, rank), random inputs."""
    from flashdora.kernels import compose as kc
    from flashdora.kernels.norm import norm_and_scales

    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(n, d_in, device=device, dtype=bf16, generator=gen) / d_in**0.5
    lora_A = torch.randn(r, d_in, device=device, generator=gen) / d_in**0.5
    lora_B = torch.randn(n, r, device=device, generator=gen) / r**0.5
    magnitude = torch.rand(n, device=device, generator=gen) + 0.5
    result = torch.randn(tokens, n, device=device, dtype=bf16, generator=gen)
    a = torch.randn(tokens, r, device=device, dtype=bf16, generator=gen)
    dy = torch.randn_like(result)
    w_sq = weight_sq_eager(weight)
    sc = scales(magnitude, torch.rand(n, device=device, generator=gen) + 0.5).contiguous()
    cast_b = kc.cast_b_first(lora_B, tokens)

    def compose_fwd():  # as ops.compose_fn._fwd runs it in a training call
        return kc.compose_fwd_fused(result, a, lora_B.to(bf16) if cast_b else lora_B, sc, 1.0, save_inner=True)

    inner = compose_fwd()[1]
    calls = {
        "compose_fwd": compose_fwd,
        "compose_bwd": lambda: kc.compose_bwd(dy, inner, sc, False),
        "norm_miss": lambda: norm_and_scales(weight, lora_A, lora_B, 1.0, magnitude, w_sq=w_sq),
    }
    return calls, cast_b


def bench_step_kernels(shapes, ranks, tokens: int, peaks: dict, reps: dict) -> list[dict]:
    """One row per (shape, rank, kernel): ``ms`` (GPU kernel time per call), ``kernels`` (each kernel's ms per call,
    by name, largest first), ``bytes``, ``flops``, ``limit_ms`` and ``of_limit`` (module docstring)."""
    device, rows = reps["device"], []
    for (d_in, n), r in ((s, r) for s in shapes for r in ranks):
        try:
            calls, cast_b = _calls(d_in, n, r, tokens, device)
        except Exception as e:  # noqa: BLE001 - the inputs or the first forward failed: rows with the error
            calls, cast_b, setup_error = dict.fromkeys(KERNELS), None, timing.describe_error(e)
        else:
            setup_error = None
        for kernel, fn in calls.items():
            nbytes, flops = _work(kernel, tokens, d_in, n, r)
            limit = max(nbytes / (peaks["copy_gbps"] * 1e9), flops / (peaks["bf16_gemm_tflops"] * 1e12)) * 1e3
            ms, by_kernel, error = None, {}, setup_error
            if fn is not None:
                try:
                    ms, by_kernel = gpu_ms(fn, warmup=reps["warmup"], reps=reps["reps"], device=device)
                except Exception as e:  # noqa: BLE001 - recorded in the row, and the sweep goes on
                    error = timing.describe_error(e)
            if error:
                print(f"bench: {d_in}x{n} r={r} {kernel} failed: {error}", file=sys.stderr)
            rows.append(
                {
                    "shape": f"{d_in}x{n}",
                    "rank": r,
                    "tokens": tokens,
                    "kernel": kernel,
                    "ms": ms,
                    "kernels": by_kernel,
                    "cast_b_first": cast_b if kernel == "compose_fwd" else None,
                    "bytes": nbytes,
                    "flops": flops,
                    "limit_ms": limit,
                    "of_limit": None if not ms else limit / ms,
                    **({"error": error} if error else {}),
                }
            )
        del calls
        timing.free_memory(device)
    return rows


def _short(name: str) -> str:
    """A kernel's name without ``void``, namespaces and template arguments."""
    return name.removeprefix("void ").split("<")[0].split("(")[0].rsplit("::", 1)[-1]


def render_step_kernels(result: dict) -> list[str]:
    """Markdown for the roofline section (empty when the run has none)."""
    rows = result.get("step_kernels")
    if not rows:
        return []
    table = [
        [
            k["shape"],
            k["rank"],
            k["tokens"],
            k["kernel"],
            None if k["ms"] is None else k["ms"] * 1e3,
            k["bytes"] / 2**20,
            k["flops"] / 1e9,
            k["limit_ms"] * 1e3,
            k["of_limit"],
            ", ".join(f"{_short(name)} {ms * 1e3:.1f}" for name, ms in k["kernels"].items()) or "-",
        ]
        for k in rows
    ]
    timed = (
        "GPU kernel time per call under torch.profiler"
        if result["device"]["type"] == "cuda"
        else "wall time per call: not a GPU, the numbers mean nothing"
    )
    return [
        "",
        f"flashdora's kernels of a training layer call against their limits ({timed}; limit = max(bytes / copy "
        "rate, FLOPs / bf16 GEMM rate), the least bytes and the matmuls' FLOPs; bf16 activations, float32 adapters):",
        "",
        record.table(
            ["shape", "r", "tokens", "call", "us", "MiB", "GFLOP", "limit us", "of limit", "kernels (us)"], table
        ),
    ]
