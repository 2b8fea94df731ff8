"""Where the factored norm's time goes, and what its GEMM could reach: pieces, a config sweep, cuBLAS beside it.

For each shape (r = 384 unless given): the whole ``factored_norm_sq`` as shipped, its pieces (the ``A A^T`` Gram
kernel, ``lora_A``'s cast, the main kernel alone, the partial sum), ``norm_and_scales`` replayed from its CUDA
graph (the model's path), cuBLAS's ``W A^T`` on the same operands (bf16 out, and fp32 out where torch has
``out_dtype``), and the main kernel over a sweep of tile configs and r-slices. Rates are 2 d_out d_in r FLOPs over
the median time, beside a bf16 8192^3 GEMM measured in the same run.

Usage (GPU): PYTHONPATH=src python3 benchmarks/norm_variants.py [--shapes 8192x28672 4096x14336] [--out DIR]
"""

import argparse
import itertools
import json
import sys

import torch
import triton

from flashdora.bench import timing
from flashdora.kernels import configs
from flashdora.kernels import norm as kn

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test under TRITON_INTERPRET=1


def ms(fn, reps=50):
    return timing.measure(fn, warmup=5, reps=reps, device=DEV).ms


def main_kernel(w, a16, b, g, part, block_r, cfg, fuse_w_sq=True):
    d_out, d_in = w.shape
    r = a16.shape[0]
    grid = (triton.cdiv(d_out, cfg["BLOCK_M"]) * triton.cdiv(r, block_r),)
    kn._norm_fwd_kernel.fn[grid](
        w, a16, b, g, part, d_out, d_in, r, 2.0, 1.0,
        w.stride(0), w.stride(1), a16.stride(0), b.stride(0), b.stride(1),
        DOT_PRECISION="tf32", GRAM_PRECISION="tf32", UPCAST_DOT=DEV == "cpu", FUSE_W_SQ=fuse_w_sq,
        BLOCK_R=block_r, BLOCK_G=configs.NORM_GRAM_BLOCK_K,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip


SWEEP = [
    dict(BLOCK_M=bm, BLOCK_K=bk, warps=wp, stages=st)
    for bm, bk, wp, st in [
        (256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 8, 5), (128, 64, 4, 4),
        (128, 128, 8, 4), (64, 128, 4, 3), (64, 64, 4, 4), (256, 32, 8, 5), (128, 32, 4, 6), (256, 128, 8, 2),
    ]
]  # fmt: skip


def shape_rows(d_in, d_out, r, gemm_tflops, sweep=True):
    flops = 2 * d_out * d_in * r
    rate = lambda t: flops / (t * 1e-3) / 1e12  # noqa: E731
    torch.manual_seed(0)
    w = torch.randn(d_out, d_in, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(r, d_in, device=DEV) / d_in**0.5
    b = torch.randn(d_out, r, device=DEV)
    m = torch.rand(d_out, device=DEV) + 0.5
    a16 = a.to(torch.bfloat16)
    g = kn.gram(a)
    rows = []
    ref = kn.factored_norm_sq(w, a, b, 1.0)

    def err(part):  # the sweep's kernels against the shipped result (the same math, other tiles)
        return ((part.sum(0) - ref).abs().max() / ref.abs().max()).item()

    def add(name, t, **extra):
        rows.append({"shape": f"{d_in}x{d_out}", "r": r, "variant": name, "ms": t, "tflops": rate(t),
                     "of_gemm": rate(t) / gemm_tflops, **extra})  # fmt: skip
        e = f" err {extra['max_rel_err']:.1e}" if "max_rel_err" in extra else ""
        print(f"{d_in}x{d_out} r={r} {name:48s} {t:8.4f} ms {rate(t):7.1f} TFLOP/s {rate(t) / gemm_tflops:6.1%}{e}")

    add("factored_norm_sq (shipped)", ms(lambda: kn.factored_norm_sq(w, a, b, 1.0)))
    if DEV == "cuda":
        graph = kn.NormGraph(w, a, b, 1.0, m)
        add("norm_and_scales, CUDA graph replay (model path)", ms(lambda: graph.graph.replay()))
    add("piece: gram(A) tf32x3 split-K", ms(lambda: kn.gram(a)))
    add("piece: A.to(bf16)", ms(lambda: a.to(torch.bfloat16)))
    add("cuBLAS W @ A16^T, bf16 out", ms(lambda: torch.mm(w, a16.T)))
    try:
        add("cuBLAS W @ A16^T, fp32 out", ms(lambda: torch.mm(w, a16.T, out_dtype=torch.float32)))
    except Exception as e:  # noqa: BLE001
        print("out_dtype mm:", type(e).__name__, e)
    w_sq = torch.linalg.vector_norm(w, dim=1, dtype=torch.float32).square_()
    add("piece: ||W||^2 torch reduction", ms(lambda: torch.linalg.vector_norm(w, dim=1, dtype=torch.float32)))

    def cublas_norm():
        c = torch.mm(w, a16.T, out_dtype=torch.float32)
        bg = torch.mm(b, g)
        return w_sq + 2.0 * (c * b).sum(1) + ((bg * b).sum(1))

    try:
        add("cuBLAS cross term + torch epilogue, ||W||^2 cached", ms(cublas_norm))
    except Exception as e:  # noqa: BLE001
        print("cublas_norm:", type(e).__name__, e)
    best = None
    for block_r, cfg in itertools.product((128, 64), SWEEP if sweep else []):
        smem = cfg["stages"] * (cfg["BLOCK_M"] + block_r) * cfg["BLOCK_K"] * 2
        if smem > 227 * 1024:
            continue
        part = torch.empty((triton.cdiv(r, block_r), d_out), device=DEV)
        try:
            t = ms(lambda: main_kernel(w, a16, b, g, part, block_r, cfg), reps=30)  # noqa: B023
        except Exception as e:  # noqa: BLE001
            print("config failed", block_r, cfg, type(e).__name__, str(e)[:100])
            continue
        add(f"main kernel BLOCK_R={block_r} {cfg}", t, block_r=block_r, max_rel_err=err(part), **cfg)
        if best is None or t < best[0]:
            best = (t, block_r, cfg)
    if best is not None:
        _, block_r, cfg = best
        part = torch.empty((triton.cdiv(r, block_r), d_out), device=DEV)
        t = ms(lambda: main_kernel(w, a16, b, g, part, block_r, cfg, fuse_w_sq=False))
        add(f"best main kernel without ||W||^2 BLOCK_R={block_r} {cfg}", t, block_r=block_r, **cfg)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["8192x28672", "4096x14336", "4096x4096"])
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--sweep", type=int, default=2, help="sweep the configs on the first N shapes (default 2)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    gemm = timing.gemm_tflops(DEV, n=8192 if DEV == "cuda" else 256)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"bf16 GEMM: {gemm:.0f} TFLOP/s; {name}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for i, s in enumerate(args.shapes):
        d_in, d_out = (int(v) for v in s.split("x"))
        rows += shape_rows(d_in, d_out, args.rank, gemm, sweep=i < args.sweep)
    if args.out:
        with open(f"{args.out}/norm_variants.json", "w") as f:
            json.dump({"gemm_tflops": gemm, "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
