"""Several adapters in one batch: the math of a layer call where each request names its own adapter (PEFT's
``adapter_names``), for DoRA and LoRA adapters alike.

A layer's adapters are stacked once per version of their weights into a ``Pack``: their A matrices side by side,
transposed (``[d_in, R]``, ``R`` the summed ranks), their B matrices side by side (``[d_out, R]``), each column's
adapter and scaling, and each adapter's DoRA scales ``(g, g - 1)`` from the norm cache (``g = 1``, ``g - 1 = 0``
for a LoRA adapter and for the base model, slot 0). A call is then two launches whatever the number of adapters:
``u = x A_all^T`` (``x @ lora_A_t``; at 16 decode tokens cuBLAS's float32 kernel for this layout took 14-21 us on
an H200 at R = 256, against 22-37 us for ``F.linear`` of the untransposed stack: benchmarks/results, "mixed-probes")
and the compose, which keeps each request's own columns of ``u`` (times its scaling), multiplies by ``B_all`` and
applies its slot's scales:

    y = result + (g - 1) (result - bias) + g s B A x        (PEFT's DoRA form; LoRA: result + s B A x)

Masked columns are exact zeros, so each row equals its adapter's computation alone. The masked matmul does
``K`` times the LoRA flops of one adapter (``K`` adapters in the pack): at r = 16 and K = 16 that is the flops of
one r = 256 adapter, small beside the base layer's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Pack(NamedTuple):
    adapters: tuple[str, ...]  # slot k (1..K) holds adapters[k - 1]; slot 0 is the base model
    lora_A_t: torch.Tensor  # [d_in, R]: the stacked A, transposed
    lora_B: torch.Tensor  # [d_out, R]
    col_slot: torch.Tensor  # [R] int32: the slot each column belongs to
    col_scale: torch.Tensor  # [R] float32: that adapter's scaling
    col_mask: torch.Tensor  # [K + 1, R]: scaling where a column belongs to the slot, else 0 (the eager form)
    scales: torch.Tensor  # [K + 1, 2, d_out] float32 (float64 for float64 magnitudes): g, g - 1


def build_pack(adapters, lora_As, lora_Bs, scalings, dora_scales) -> Pack:
    """The ``Pack`` of ``adapters`` (names, in slot order) from their weights, scalings and DoRA scales
    (``[>= 2, d_out]`` from the norm cache; ``None`` for a LoRA adapter). Made without autograd."""
    with torch.no_grad():  # (device ops only, no copies from the host: this may run inside CUDA graph capture)
        lora_A = torch.cat([a.t() for a in lora_As], dim=1) if len(lora_As) > 1 else lora_As[0].t().contiguous()
        lora_B = torch.cat(list(lora_Bs), dim=1) if len(lora_Bs) > 1 else lora_Bs[0]
        device, d_out, total = lora_A.device, lora_B.shape[0], lora_A.shape[1]
        ranks = [a.shape[0] for a in lora_As]
        f32, i32 = torch.float32, torch.int32
        col_slot = torch.cat([torch.full((r,), k, dtype=i32, device=device) for k, r in enumerate(ranks, 1)])
        col_scale = torch.cat([torch.full((r,), s, dtype=f32, device=device) for r, s in zip(ranks, scalings)])
        # (the mask's scalings straight from the Python floats, in the adapters' dtype: float64 stays exact)
        a_dtype = lora_A.dtype
        mask_scale = torch.cat([torch.full((r,), s, dtype=a_dtype, device=device) for r, s in zip(ranks, scalings)])
        col_mask = torch.zeros(len(adapters) + 1, total, dtype=a_dtype, device=device)
        col_mask.scatter_(0, col_slot.long()[None], mask_scale[None])
        dtype = torch.float64 if any(s is not None and s.dtype == torch.float64 for s in dora_scales) else f32
        scales = torch.zeros(len(adapters) + 1, 2, d_out, dtype=dtype, device=device)
        scales[:, 0] = 1.0
        for k, s in enumerate(dora_scales, start=1):
            if s is not None:
                scales[k] = s[:2]
    return Pack(tuple(adapters), lora_A, lora_B, col_slot, col_scale, col_mask, scales)


def mixed_eager(result, x, pack: Pack, row_slot, bias=None) -> torch.Tensor:
    """The mixed call in plain torch ops (the CPU, float64, and the form ``torch.compile`` traces): ``y`` like
    ``result``. ``x``: ``[B, ..., d_in]`` in the adapters' dtype; ``row_slot``: ``[B]`` int (0: the base model)."""
    b = row_slot.shape[0]
    slots = row_slot.long()
    lead = (b,) + (1,) * (result.dim() - 2)  # each request's scales broadcast over its tokens
    u = (x @ pack.lora_A_t) * pack.col_mask[slots].view(*lead, -1)
    lora = F.linear(u, pack.lora_B)
    scales = pack.scales[slots]  # [B, 2, d_out]
    acc = torch.promote_types(scales.dtype, lora.dtype)
    res = result.to(acc)
    base = res if bias is None else (result - bias).to(acc)
    y = res + scales[:, 1].view(*lead, -1) * base + scales[:, 0].view(*lead, -1) * lora.to(acc)
    return y.to(result.dtype)


def mixed_compose(compose: str, result, x, pack: Pack, row_slot, bias=None) -> torch.Tensor:
    """The route's compose: ``mixed-triton`` (``kernels/mixed.py``: the matmul against ``B_all``, the masks and the
    scales in one launch) or ``mixed-eager`` / ``mixed-traced`` (``mixed_eager``)."""
    if compose != "mixed-triton":
        return mixed_eager(result, x, pack, row_slot, bias)
    from flashdora.kernels.mixed import mixed_fwd

    u = x @ pack.lora_A_t
    return mixed_fwd(result, u, pack.lora_B, pack.scales, row_slot, pack.col_slot, pack.col_scale, bias)
