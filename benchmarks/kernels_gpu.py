"""One-shot GPU check and timing of the Triton kernels against the device's measured ceilings.

Run on a CUDA machine from the repo root: ``PYTHONPATH=src python3 benchmarks/kernels_gpu.py`` (writes
``$OUT/kernels_gpu.json``, or ``--out PATH``). Measures the copy bandwidth and the bf16 GEMM rate first, then the
compose forward/backward (GB/s), the fused LoRA-B compose vs matmul + compose, and the factored norm (TFLOP/s of
the cross term), each with its error against float64. Timer: ``triton.testing.do_bench`` median (it flushes L2
before every repetition).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from functools import partial

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from flashdora.kernels import compose as kc
from flashdora.kernels import configs
from flashdora.kernels import norm as kn
from flashdora.ops.compose import compose_fwd_eager
from flashdora.ops.norm import norm_sq_eager

BF16 = torch.bfloat16
ROWS: list[dict] = []


def ms_of(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms_of(fn) -> float:
    """Median of CUDA-graph replays: the kernel time without Python launch overhead (L2 not flushed)."""
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # capture can fail on some paths: record it rather than abort the run
        print("  cudagraph timing failed:", type(exc).__name__, str(exc)[:200], flush=True)
        return float("nan")


def first_call_s(fn) -> float:
    """Wall time of the first call (compile + autotune), synchronized."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def row(**kw):
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def ceilings() -> tuple[float, float]:
    x = torch.randn(2**29, device="cuda", dtype=BF16)  # 1 GiB
    y = torch.empty_like(x)
    copy_gbs = 2 * x.nbytes / ms_of(partial(y.copy_, x)) / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    gemm_tflops = 2 * 8192**3 / ms_of(partial(torch.matmul, a, b)) / 1e9
    row(bench="ceiling", what="copy 1 GiB bf16 (read + write)", gbs=copy_gbs)
    row(bench="ceiling", what="bf16 GEMM 8192^3", tflops=gemm_tflops)
    return copy_gbs, gemm_tflops


def bench_compose(copy_gbs: float):
    for t, n in [(2048, 4096), (8192, 4096), (2048, 28672), (8192, 28672)]:
        result = torch.randn(t, n, device="cuda", dtype=BF16)
        lora = torch.randn(t, n, device="cuda", dtype=BF16)
        lx_base = torch.randn(t, n, device="cuda", dtype=BF16)
        bias = torch.randn(n, device="cuda", dtype=BF16)
        g = 0.5 + torch.rand(n, device="cuda")
        gm1 = g - 1
        e = result.element_size()
        for mode, lb in [("fwd", None), ("fwd lx_base", lx_base)]:
            fn = partial(kc.compose_fwd, result, lora, g, gm1, 0.7, bias, lb)
            compile_s = first_call_s(fn)
            y, inner = fn()
            ey, einner = compose_fwd_eager(result, lora, g, gm1, 0.7, bias, lb)
            nbytes = t * n * e * (4 + (lb is not None))
            ms, graph_ms = ms_of(fn), graph_ms_of(fn)
            eager_ms = ms_of(partial(compose_fwd_eager, result, lora, g, gm1, 0.7, bias, lb))
            row(bench="compose", mode=mode, tokens=t, d_out=n, dtype="bf16", ms=ms, gbs=nbytes / ms / 1e6,
                pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, graph_ms=graph_ms,
                graph_pct_copy=100 * nbytes / graph_ms / 1e6 / copy_gbs, eager_ms=eager_ms, compile_s=compile_s,
                err_y_vs_eager=rel(y, ey), err_inner_vs_eager=rel(inner, einner))  # fmt: skip
        dy = torch.randn(t, n, device="cuda", dtype=BF16)
        for mode, has_lb in [("bwd", False), ("bwd lx_base", True)]:
            fn = partial(kc.compose_bwd, dy, lora, g, gm1, has_lb)
            compile_s = first_call_s(fn)
            gdy, _, dg = fn()
            ref_dg = (dy.double() * lora.double()).sum(0)
            nbytes = t * n * e * (3 + has_lb)
            ms, graph_ms = ms_of(fn), graph_ms_of(fn)
            row(bench="compose", mode=mode, tokens=t, d_out=n, dtype="bf16", ms=ms, gbs=nbytes / ms / 1e6,
                pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, graph_ms=graph_ms,
                graph_pct_copy=100 * nbytes / graph_ms / 1e6 / copy_gbs, compile_s=compile_s,
                err_gdy=rel(gdy, g.double() * dy.double()), err_dg=rel(dg, ref_dg),
                dg_bitwise_repeatable=bool(torch.equal(dg, fn()[2])))  # fmt: skip


def _unfused(result, a, b_c, g, gm1, bias):
    return kc.compose_fwd(result, a @ b_c.T, g, gm1, 0.7, bias)


def bench_fused(copy_gbs: float):
    for t, n, r in [(8192, 4096, 16), (8192, 4096, 64), (8192, 28672, 16), (2048, 28672, 64), (8192, 4096, 384)]:
        result = torch.randn(t, n, device="cuda", dtype=BF16)
        a = torch.randn(t, r, device="cuda", dtype=BF16)
        lora_B = torch.randn(n, r, device="cuda") / r**0.5
        bias = torch.randn(n, device="cuda", dtype=BF16)
        g = 0.5 + torch.rand(n, device="cuda")
        gm1 = g - 1
        b_c = lora_B.to(BF16)
        unfused = partial(_unfused, result, a, b_c, g, gm1, bias)
        fused = partial(kc.compose_fwd_fused, result, a, lora_B, g, gm1, 0.7, bias)

        compile_s = first_call_s(fused)
        first_call_s(unfused)
        ref = g.double() * (result.double() - bias.double() + 0.7 * (a.double() @ b_c.double().T)) + bias.double()
        ms_u, ms_f = ms_of(unfused), ms_of(fused)
        gms_u, gms_f = graph_ms_of(unfused), graph_ms_of(fused)
        nbytes = t * n * 2 * 3  # fused minimum: read result, write y and inner
        row(bench="compose_fused", tokens=t, d_out=n, r=r, dtype="bf16", unfused_ms=ms_u, fused_ms=ms_f,
            speedup=ms_u / ms_f, graph_unfused_ms=gms_u, graph_fused_ms=gms_f, graph_speedup=gms_u / gms_f,
            fused_gbs=nbytes / ms_f / 1e6, fused_pct_copy=100 * nbytes / ms_f / 1e6 / copy_gbs,
            graph_fused_pct_copy=100 * nbytes / gms_f / 1e6 / copy_gbs,
            compile_s=compile_s, err_fused=rel(fused()[0], ref), err_unfused=rel(unfused()[0], ref))  # fmt: skip


def _peft_dense_norm(weight, lora_A, lora_B, s):
    return torch.linalg.norm(weight + s * (lora_B @ lora_A), dim=1)


def _norm_ref(weight, lora_A, lora_B, s):
    out = torch.empty(weight.shape[0], dtype=torch.float64, device=weight.device)
    a64 = lora_A.double()
    for i in range(0, weight.shape[0], 4096):
        rows = weight[i : i + 4096].double() + s * (lora_B[i : i + 4096].double() @ a64)
        out[i : i + 4096] = rows.norm(dim=1)
    return out


def bench_norm(gemm_tflops: float):
    shapes = [  # (d_out, d_in, r, weight dtype, transposed)
        (28672, 8192, 384, BF16, False),
        (28672, 8192, 384, BF16, True),
        (4096, 4096, 16, BF16, False),
        (4096, 4096, 64, BF16, False),
        (11008, 4096, 1024, BF16, False),
        (4096, 4096, 64, torch.float32, False),
        (2304, 768, 64, torch.float32, True),
    ]
    for d_out, d_in, r, wd, transposed in shapes:
        if transposed:
            weight = (torch.randn(d_in, d_out, device="cuda") / d_in**0.5).to(wd).T
        else:
            weight = (torch.randn(d_out, d_in, device="cuda") / d_in**0.5).to(wd)
        lora_A = torch.randn(r, d_in, device="cuda") / d_in**0.5
        lora_B = torch.randn(d_out, r, device="cuda") / r**0.5
        s = 2.0
        fn = partial(kn.factored_norm_sq, weight, lora_A, lora_B, s)
        compile_s = first_call_s(fn)
        out = fn().clamp_min(0).sqrt()
        ref = _norm_ref(weight, lora_A, lora_B, s)
        ms = ms_of(fn)
        eager_ms = ms_of(partial(norm_sq_eager, weight, lora_A, lora_B, s))
        gram_ms = ms_of(partial(kn.gram, lora_A))
        flops = 2 * d_out * d_in * r
        best = getattr(kn._norm_fwd_kernel, "best_config", None)
        entry = dict(bench="norm", d_out=d_out, d_in=d_in, r=r, weight_dtype=str(wd).removeprefix("torch."),
                     transposed=transposed, ms=ms, tflops=flops / ms / 1e9,
                     pct_gemm=100 * flops / ms / 1e9 / gemm_tflops, eager_ms=eager_ms, gram_ms=gram_ms,
                     compile_s=compile_s, rel_err=rel(out, ref), best_config=str(best))  # fmt: skip
        if (d_out, d_in, r, wd, transposed) == shapes[0]:
            entry["peft_dense_ms"] = ms_of(partial(_peft_dense_norm, weight, lora_A, lora_B, s))
            entry["sweep"] = sweep_norm(weight, lora_A, lora_B, s, gemm_tflops)
        row(**entry)


def sweep_norm(weight, lora_A, lora_B, s, gemm_tflops):
    """Kernel-only time of hand-picked configs at one shape (to tune configs.NORM_FWD), fused ||W||^2 on and off."""
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    a = lora_A.to(weight.dtype).contiguous()
    gram = kn.gram(lora_A)
    br = configs.norm_block_r(r)
    part = torch.empty((triton.cdiv(r, br), d_out), device="cuda")
    out = []
    for bm, bk, w, st, fuse in [
        (256, 64, 8, 3, True), (256, 64, 8, 3, False), (256, 64, 8, 4, True), (128, 128, 8, 3, True),
    ]:  # fmt: skip
        grid = (triton.cdiv(d_out, bm) * triton.cdiv(r, br),)
        run = partial(
            kn._norm_fwd_kernel.fn[grid],
            weight, a, lora_B, gram, part, d_out, d_in, r, 2 * s, s * s,
            weight.stride(0), weight.stride(1), a.stride(0), lora_B.stride(0), lora_B.stride(1),
            DOT_PRECISION="tf32", GRAM_PRECISION="tf32", UPCAST_DOT=False, FUSE_W_SQ=fuse, BLOCK_G=32,
            BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, num_warps=w, num_stages=st,
        )  # fmt: skip
        cfg = dict(config=[bm, br, bk, w, st], fuse_w_sq=fuse)
        try:
            run()
            ms = ms_of(run)
            tf = 2 * d_out * d_in * r / ms / 1e9
            out.append(dict(**cfg, ms=ms, tflops=tf, pct_gemm=100 * tf / gemm_tflops))
        except Exception as exc:  # out of shared memory etc.: record and go on
            out.append(dict(**cfg, error=type(exc).__name__ + ": " + str(exc)[:200]))
        print("  sweep", out[-1], flush=True)
    w_sq_ms = ms_of(partial(torch.linalg.vector_norm, weight, dim=1, dtype=torch.float32))
    a32 = lora_A.float()
    gram_torch_fp32_ms = ms_of(partial(torch.mm, a32, a32.T))
    gram_tf32x3_ms = ms_of(partial(kn.gram, lora_A))
    g3_err = rel(kn.gram(lora_A), lora_A.double() @ lora_A.double().T)
    cast_ms = ms_of(partial(lora_A.to, weight.dtype))
    cublas_cross_ms = ms_of(partial(torch.matmul, weight, a.T))
    unfused_w_sq_ms = ms_of(partial(kn.factored_norm_sq, weight, lora_A, lora_B, s, fuse_w_sq=False))
    extra = dict(torch_w_sq_ms=w_sq_ms, gram_torch_fp32_ms=gram_torch_fp32_ms,
                 gram_tf32x3_ms=gram_tf32x3_ms, gram_tf32x3_rel_err=g3_err, cast_A_ms=cast_ms,
                 cublas_cross_term_ms=cublas_cross_ms,
                 cublas_cross_term_pct_gemm=100 * 2 * d_out * d_in * r / cublas_cross_ms / 1e9 / gemm_tflops,
                 full_call_w_sq_separate_ms=unfused_w_sq_ms)  # fmt: skip
    print("  sweep extra", extra, flush=True)
    return dict(configs=out, **extra)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels_gpu.json"))
    parser.add_argument("--only", default="compose,fused,norm")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_gbs, gemm_tflops = ceilings()
    parts = args.only.split(",")
    if "norm" in parts:
        bench_norm(gemm_tflops)
    if "compose" in parts:
        bench_compose(copy_gbs)
    if "fused" in parts:
        bench_fused(copy_gbs)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    doc = dict(
        bench="kernels_gpu", command=" ".join([sys.executable, *sys.argv]), commit=commit,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        device=dict(name=props.name, capability=list(torch.cuda.get_device_capability(0)),
                    memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count),
        versions=dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                      cuda=torch.version.cuda),
        protocol=dict(timer="triton.testing.do_bench", warmup_ms=25, rep_ms=100, statistic="median",
                      l2="flushed before each repetition by do_bench"),
        rows=ROWS,
    )  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
