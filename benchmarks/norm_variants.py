"""The factored norm's time and accuracy, piece by piece, against a bf16 GEMM and a float64 reference.

For each shape (bf16 W, fp32 adapters, r = 384 unless given): the norm as shipped (``||W||^2`` computed, and
given as the norm cache keeps it), its CUDA-graph replay (the model's path), its pieces (the cast of A, the
Gram GEMM, the cross-term GEMM, the Triton epilogue, ``||W||^2``), and with ``--old FILE`` (a ``kernels/norm.py``
of an earlier commit, e.g. ``git show 87cfff6:src/flashdora/kernels/norm.py``) that kernel over a sweep of tile
configs, with and without its in-loop ``||W||^2``. ``err``: max relative error of the squared norms against float64.

``--sweep`` adds the epilogue over tile configs. (Sixth session: a grid walking the r-slices first and a
symmetric-Gram form were swept and dropped, ``*_norm-variants-0b1f414.txt``; so was the Gram as a split-K batched
GEMM, ``*_norm-variants-ce08e82.txt``.)

Usage (GPU): PYTHONPATH=src python3 benchmarks/norm_variants.py [--shapes 8192x28672 4096x14336] [--old F] [--sweep]
[--out D]
"""

import argparse
import importlib.util
import json
import sys

import torch
import triton

from flashdora.bench import timing
from flashdora.kernels import norm as kn
from flashdora.kernels import norm_gemm as ng
from flashdora.reference import row_norm_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test under TRITON_INTERPRET=1
OLD_SWEEP = [
    dict(BLOCK_M=bm, BLOCK_K=bk, num_warps=wp, num_stages=st)
    for bm, bk, wp, st in [
        (256, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4),
        (256, 32, 8, 5),
    ]
]  # fmt: skip
EPILOGUE_SWEEP = [
    dict(BLOCK_M=bm, BLOCK_G=bg, num_warps=wp, num_stages=st)
    for bm, bg, wp, st in [
        (16, 32, 2, 2), (32, 32, 2, 3), (32, 32, 4, 2), (32, 64, 4, 3), (64, 32, 2, 3), (64, 32, 4, 3),
        (64, 64, 4, 4), (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (256, 32, 8, 3),
    ]
]  # fmt: skip


def ms(fn, reps=50):
    return timing.measure(fn, warmup=5, reps=reps, device=DEV).ms


def old_kernel_rows(old, w, a, b, ref, add):
    """The earlier fused kernel (16-bit path) per config, with and without its in-loop ||W||^2."""
    d_out, d_in = w.shape
    r = a.shape[0]
    a16, g = a.to(w.dtype), old.gram(a)
    w_sq = ng.weight_sq(w)
    add("old: factored_norm_sq as shipped then (autotuned)", ms(lambda: old.factored_norm_sq(w, a, b, 1.0)),
        old.factored_norm_sq(w, a, b, 1.0))  # fmt: skip
    block_r = 128
    for cfg in OLD_SWEEP:
        for fuse in (True, False):
            part = torch.empty((triton.cdiv(r, block_r), d_out), device=DEV)

            def run(cfg=cfg, fuse=fuse, part=part):
                grid = (triton.cdiv(d_out, cfg["BLOCK_M"]) * triton.cdiv(r, block_r),)
                old._norm_fwd_kernel.fn[grid](
                    w, a16, b, g, part, d_out, d_in, r, 2.0, 1.0,
                    w.stride(0), w.stride(1), a16.stride(0), b.stride(0), b.stride(1),
                    DOT_PRECISION="tf32", GRAM_PRECISION="tf32", UPCAST_DOT=DEV == "cpu", FUSE_W_SQ=fuse,
                    BLOCK_R=block_r, BLOCK_G=32, **cfg,
                )  # fmt: skip

            try:
                t = ms(run, reps=20)
            except Exception as e:  # noqa: BLE001
                print("config failed", cfg, fuse, type(e).__name__, str(e)[:100])
                continue
            sq = part.sum(0) + (0 if fuse else w_sq)
            add(f"old kernel {cfg} in-loop ||W||^2={fuse}", t, sq)


def sweep_rows(epi_args, part, block_j, d_out, r, add):
    """The epilogue over a sweep of tile configs (its row sums checked against the autotuned kernel's)."""
    want = part.clone()
    grid = lambda cfg: (triton.cdiv(d_out, cfg["BLOCK_M"]), triton.cdiv(r, block_j))  # noqa: E731
    for cfg in EPILOGUE_SWEEP:
        part.fill_(float("nan"))
        try:
            t = ms(lambda cfg=cfg: ng._epilogue_kernel.fn[grid(cfg)](*epi_args, BLOCK_J=block_j, **cfg), reps=30)
        except Exception as e:  # noqa: BLE001
            print("config failed", cfg, type(e).__name__, str(e)[:100])
            continue
        diff = ((part.sum(0) - want.sum(0)).abs().max() / want.sum(0).abs().max()).item()
        add(f"epilogue {tuple(cfg.values())} (diff {diff:.0e})", t)


def shape_rows(d_in, d_out, r, gemm_tflops, old=None, sweep=False):
    flops = 2 * d_out * d_in * r
    rate = lambda t: flops / (t * 1e-3) / 1e12  # noqa: E731
    torch.manual_seed(0)
    w = torch.randn(d_out, d_in, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(r, d_in, device=DEV) / d_in**0.5
    b = torch.randn(d_out, r, device=DEV)
    m = torch.rand(d_out, device=DEV) + 0.5
    ref = row_norm_ref(w.double(), a.double(), b.double(), 1.0).square_()
    rows = []

    def add(name, t, sq=None):
        err = None if sq is None else ((sq.double() - ref).abs().max() / ref.abs().max()).item()
        rows.append({"shape": f"{d_in}x{d_out}", "r": r, "variant": name, "ms": t, "tflops": rate(t),
                     "of_gemm": rate(t) / gemm_tflops, "max_rel_err_vs_f64": err})  # fmt: skip
        e = "" if err is None else f"  err {err:.1e}"
        print(f"{d_in}x{d_out} r={r} {name:58s} {t:8.4f} ms {rate(t):7.1f} TFLOP/s {rate(t) / gemm_tflops:6.1%}{e}")

    w_sq = ng.weight_sq(w)
    for label, given in (("computed", None), ("given (cached)", w_sq)):
        fn = lambda given=given: kn.factored_norm_sq(w, a, b, 1.0, given)  # noqa: E731
        add(f"factored_norm_sq, ||W||^2 {label}", ms(fn), fn())
    if DEV == "cuda":
        graph = kn.NormGraph(w, a, b, 1.0, m, w_sq)
        add("norm_and_scales, CUDA graph replay (model path)", ms(lambda: graph.graph.replay()), graph()[0].square())
    a16 = a.to(w.dtype)
    g = ng.gram(a16)
    add("piece: A to bf16", ms(lambda: a.to(w.dtype)))
    add("piece: Gram a a^T (cuBLAS, fp32 out)", ms(lambda: ng.gram(a16)))
    add("piece: cross term W a^T (cuBLAS, fp32 out)", ms(lambda: ng._mm_f32(w, a16.T)))
    add("piece: ||W||^2 (Triton row reduction)", ms(lambda: ng.weight_sq(w)))
    c = ng._mm_f32(w, a16.T)
    block_j = kn.configs.norm_block_r(r)
    part = torch.empty((triton.cdiv(r, block_j), d_out), device=DEV)
    epi_args = (c, b, g, w_sq, part, d_out, r, 2.0, 1.0, c.stride(0), 1, b.stride(0), b.stride(1), part.stride(0))
    grid = lambda meta: (triton.cdiv(d_out, meta["BLOCK_M"]), triton.cdiv(r, block_j))  # noqa: E731
    epilogue = lambda: ng._epilogue_kernel[grid](*epi_args, BLOCK_J=block_j)  # noqa: E731
    add("piece: Triton epilogue (B G on TF32, row-dot)", ms(epilogue))
    print("    autotuned config:", getattr(ng._epilogue_kernel, "best_config", None))
    add("cuBLAS W @ A16^T alone, bf16 out (reference rate)", ms(lambda: torch.mm(w, a16.T)))
    if sweep:
        sweep_rows(epi_args, part, block_j, d_out, r, add)
    if old is not None:
        old_kernel_rows(old, w, a, b, ref, add)
    return rows


def repeat_rows(shape, r, n):
    """The norm's CUDA-graph replay (model path) against the bf16 GEMM, measured alternately ``n`` times."""
    d_in, d_out = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    w = torch.randn(d_out, d_in, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(r, d_in, device=DEV) / d_in**0.5
    b = torch.randn(d_out, r, device=DEV)
    m = torch.rand(d_out, device=DEV) + 0.5
    graph = kn.NormGraph(w, a, b, 1.0, m, ng.weight_sq(w))
    shares = []
    for i in range(n):
        gemm = timing.gemm_tflops(DEV, n=8192)
        t = ms(lambda: graph.graph.replay(), reps=200)
        shares.append(2 * d_out * d_in * r / (t * 1e-3) / 1e12 / gemm)
        share = f"{shares[-1]:.1%} of it"
        print(f"{shape} r={r} repeat {i}: graph replay {t:.4f} ms, bf16 GEMM {gemm:.0f} TFLOP/s, {share}")
    shares.sort()
    print(f"{shape} r={r}: median {shares[n // 2]:.1%}, min {shares[0]:.1%}, max {shares[-1]:.1%} over {n} repeats")


def load_old(path):
    """The earlier module, autotuning over the config list it shipped with (87cfff6's NORM_FWD)."""
    spec = importlib.util.spec_from_file_location("old_norm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if DEV == "cuda":
        mod._norm_fwd_kernel.configs = [
            triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_K": c["BLOCK_K"]}, num_warps=c["num_warps"],
                          num_stages=c["num_stages"])
            for c in OLD_SWEEP[:6]
        ]  # fmt: skip
    return mod


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["8192x28672", "4096x14336", "4096x4096"])
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--old", default=None, help="an earlier kernels/norm.py to sweep (first two shapes)")
    p.add_argument("--sweep", action="store_true", help="epilogue tile configs (first two shapes)")
    p.add_argument(
        "--repeat", type=int, default=0,
        help="only: the first shape's graph replay and the bf16 GEMM, N times alternately (the run-to-run spread of "
        "the norm's share of the GEMM rate)",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.repeat:
        repeat_rows(args.shapes[0], args.rank, args.repeat)
        sys.exit(0)
    gemm = timing.gemm_tflops(DEV, n=8192 if DEV == "cuda" else 256)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"bf16 GEMM: {gemm:.0f} TFLOP/s; {name}, torch {torch.__version__}, triton {triton.__version__}")
    old = load_old(args.old) if args.old else None
    rows = []
    for i, s in enumerate(args.shapes):
        d_in, d_out = (int(v) for v in s.split("x"))
        rows += shape_rows(d_in, d_out, args.rank, gemm, old if i < 2 else None, args.sweep and i < 2)
    if args.out:
        with open(f"{args.out}/norm_variants.json", "w") as f:
            json.dump({"gemm_tflops": gemm, "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
