"""The norm's cross-term GEMM in two layouts, each as a CUDA-graph replay, against the bf16 GEMM rate (GPU).

``C = W a^T`` is ``[d_out, r]``: M = d_out, N = r, and at r = 384 cuBLAS's output tiles fill its waves unevenly.
``C^T = a W^T`` is the same product with M = r, N = d_out, which cuBLAS tiles differently. Also times the whole
16-bit norm (``||W||^2`` given, as the cache keeps it) with each layout, and with the one it chooses. Graph
replays of ``--replays`` calls, the median of ``--repeat`` alternating turns, so that host gaps and drift fall out.

Usage: PYTHONPATH=src python3 benchmarks/norm_gemm_layout.py [--shapes 8192x28672 ...] [--rank 384]
[--repeat 5]
"""

import argparse
import statistics

import torch

from flashdora.kernels import norm_gemm as ng

p = argparse.ArgumentParser()
SHAPES = ["8192x28672", "5120x27648", "4096x14336", "14336x4096", "4096x4096"]
p.add_argument("--shapes", nargs="+", default=SHAPES)
p.add_argument("--rank", type=int, default=384)
p.add_argument("--repeat", type=int, default=5)
p.add_argument("--replays", type=int, default=20)
args = p.parse_args()


def graph_ms(fn, replays):
    """GPU ms per call of ``fn``, from one CUDA graph of ``replays`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(replays):
            fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / replays


def _norm_in(transposed, w, a, b, w_sq):
    """The whole 16-bit norm (``||W||^2`` given, as the cache keeps it) with its cross term in one layout."""
    key = (*w.shape, a.shape[0], w.dtype, w.device)
    chosen = ng._TRANSPOSED.get(key)
    ng._TRANSPOSED[key] = transposed
    try:
        return ng.norm_half(w, a, b, 1.0, w_sq)
    finally:
        if chosen is None:
            del ng._TRANSPOSED[key]
        else:
            ng._TRANSPOSED[key] = chosen


n = 8192
x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
print(f"# {torch.cuda.get_device_name()}, r = {args.rank}; ms per call (graph replay), median of {args.repeat} turns")


def measure(shape):
    """The rows of one shape: each variant's replays, alternating over ``--repeat`` turns."""
    d_in, d_out = (int(v) for v in shape.split("x"))
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(args.rank, d_in, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(d_out, args.rank, device="cuda")
    w_sq = ng.weight_sq(w)
    variants = {
        "gemm 8192^3": lambda: torch.mm(x, y),
        "C = W a^T (shipped)": lambda: torch.mm(w, a.T, out_dtype=torch.float32),
        "C^T = a W^T": lambda: torch.mm(a, w.T, out_dtype=torch.float32),
        "norm, C": lambda: _norm_in(False, w, a, b, w_sq),
        "norm, C^T": lambda: _norm_in(True, w, a, b, w_sq),
        "norm as chosen": lambda: ng.norm_half(w, a, b, 1.0, w_sq),
    }
    times = {k: [] for k in variants}
    for _ in range(args.repeat):
        for k, fn in variants.items():
            times[k].append(graph_ms(fn, args.replays))
    gemm_tflops = 2 * n**3 / (statistics.median(times["gemm 8192^3"]) * 1e-3) / 1e12
    flops = 2 * d_out * d_in * args.rank
    chosen = ng._TRANSPOSED.get((d_out, d_in, args.rank, w.dtype, w.device))
    print(f"{shape:11s} chosen layout: {'C^T' if chosen else 'C'}")
    for k, ts in times.items():
        med = statistics.median(ts)
        rate = (2 * n**3 if k.startswith("gemm") else flops) / (med * 1e-3) / 1e12
        print(
            f"{shape:11s} {k:22s} {med:8.4f} ms ({min(ts):.4f}-{max(ts):.4f}) {rate:6.1f} TFLOP/s "
            f"{rate / gemm_tflops:6.1%} of the bf16 GEMM"
        )


for shape in args.shapes:
    measure(shape)
