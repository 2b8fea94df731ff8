"""The forward compose with its LoRA B matmul: fused (B in float32 or bf16) against cuBLAS + the compose kernel (GPU).

Each variant is captured in a CUDA graph and replayed (GPU time only, no host), at T tokens and r = 384 for several
d_out, with bf16 ``result`` and ``a`` (the autocast case) and the adapters' float32 ``lora_B``:

- ``fused fp32 B``: ``compose_fwd_fused`` as the forward runs it now (B cast to bf16 in registers);
- ``fused bf16 B``: the same kernel given a bf16 B (the cast done elsewhere), and ``cast + fused bf16 B`` with it;
- ``cuBLAS + compose``: ``lora = a B^T`` by cuBLAS (bf16 B), then the unfused compose kernel;
- ``cuBLAS a B^T alone`` and the bytes the compose must move at copy speed, for scale.

Usage: PYTHONPATH=src python3 benchmarks/fused_variants.py [--tokens 2048] [--save-inner]
"""

import argparse

import torch
import triton

from flashdora.bench import timing
from flashdora.kernels import compose as kc

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=2048)
p.add_argument("--rank", type=int, default=384)
p.add_argument("--d-out", type=int, nargs="+", default=[1024, 4096, 14336, 27648])
p.add_argument("--save-inner", action="store_true")
p.add_argument("--sweep", action="store_true", help="also time the fused kernel (float32 B) under each tile config")
args = p.parse_args()
dev = torch.device("cuda")
t, r, save = args.tokens, args.rank, args.save_inner


def graph_ms(fn, reps=50):
    """Median ms of one replay of ``fn`` captured in a CUDA graph (after eager warm-up, which also tunes)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timing.measure(graph.replay, warmup=5, reps=reps, device=dev).ms


SWEEP = [
    (64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (64, 256, 32, 8, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3),
    (128, 256, 32, 8, 3), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4), (256, 128, 32, 8, 3), (64, 64, 64, 4, 4),
    (128, 128, 16, 8, 4), (64, 256, 64, 8, 3),
]  # fmt: skip


def copy_speed() -> float:
    """Device-to-device copy, GB/s (bytes read + written), graph-replayed."""
    src = torch.empty(2**28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_ms(lambda: dst.copy_(src)) / 1e6


def sweep(res, a, b32, g, gm1, n):
    """The fused kernel (float32 B) under each tile config of ``SWEEP``; prints the five fastest."""
    y, inner = torch.empty_like(res), torch.empty_like(res)
    sc = torch.stack([g, gm1])
    kargs = (res, a, b32, res, sc, sc, y, inner, t, n, r, 1.0, n, r, r, n, n, n, n)
    flags = dict(
        HAS_BIAS=False, HAS_LX_BASE=False, SAVE_INNER=save, ROUND_BASE=False, EMULATE_RNE=False,
        DOT_PRECISION="tf32", UPCAST_DOT=False,
    )  # fmt: skip
    times = []
    for bm, bn, bk, warps, stages in SWEEP:
        grid = (triton.cdiv(t, bm), triton.cdiv(n, bn))

        def run(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, grid=grid):
            kc._compose_fused_fwd_kernel.fn[grid](
                *kargs, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages
            )

        try:
            times.append((graph_ms(run), (bm, bn, bk, warps, stages)))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            print(f"  config {(bm, bn, bk, warps, stages)} failed: {type(e).__name__}")
    best = ", ".join(f"{c} {ms:.4f}" for ms, c in sorted(times)[:5])
    print(f"  sweep d_out {n} save_inner {save} (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), best five ms: {best}")


def measure(n, copy_gbs):
    """Every variant at one d_out: their difference from cuBLAS + compose, then their graph-replay times."""
    torch.manual_seed(0)
    res = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
    a = torch.randn(t, r, device=dev, dtype=torch.bfloat16)
    b32 = torch.randn(n, r, device=dev) / r**0.5
    b16 = b32.to(torch.bfloat16)
    g = torch.rand(n, device=dev) + 0.5
    gm1 = g - 1
    sc = torch.stack([g, gm1])
    moved = t * n * 2 * (3 if save else 2)  # result read, y (and inner) written

    def fused(b):
        return kc.compose_fwd_fused(res, a, b, sc, 1.0, save_inner=save)

    def unfused():
        return kc.compose_fwd(res, torch.nn.functional.linear(a, b16), sc, 1.0, save_inner=save)

    variants = {
        "fused fp32 B": lambda: fused(b32),
        "fused bf16 B": lambda: fused(b16),
        "cast + fused bf16 B": lambda: fused(b32.to(torch.bfloat16)),
        "cuBLAS + compose": unfused,
        "cuBLAS a B^T alone": lambda: torch.nn.functional.linear(a, b16),
    }
    ref = unfused()[0].float()
    for name in ("fused fp32 B", "fused bf16 B"):
        got = variants[name]()[0].float()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"d_out {n}: {name} vs cuBLAS + compose, relative difference {err:.2e}")
    floor = moved / copy_gbs / 1e6
    line = ", ".join(f"{name} {graph_ms(fn):.4f}" for name, fn in variants.items())
    print(f"T {t} r {r} d_out {n} save_inner {save}: ms {line}; compose bytes at copy speed {floor:.4f}")
    if args.sweep:
        sweep(res, a, b32, g, gm1, n)


copy_gbs = copy_speed()
for n in args.d_out:
    measure(n, copy_gbs)
print(f"copy {copy_gbs:.0f} GB/s")
