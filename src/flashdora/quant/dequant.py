"""A bitsandbytes layer's weight as a dense tensor: PEFT's dequantization, and the dense weight a forward holds.

``dequantized`` is what a norm-cache miss on a bitsandbytes base reads: a 4-bit weight dequantized by bitsandbytes'
own kernels (launched from C++ where the call's route is ``native``: the caller passes ``native.bridge`` as
``fast``; quant never imports the extension), an 8-bit one by one Triton kernel or a row chunk at a time. Where
``quant.base.run`` computed the layer's base result itself, the 4-bit weight its forward dequantized is kept here
(``keep_dense``) until the layer's call ends (``release``), and the miss takes it (``kept_dense``) instead of
dequantizing again.
"""

from __future__ import annotations

import torch

from flashdora import backend
from flashdora.config import bnb_tested  # noqa: F401 (quant.base asks it here)

_dense: tuple | None = None  # (packed's data_ptr, its version, quant_state, dense weight) of the last forward


def dequantized(base, packed: torch.Tensor | None = None, dtype: torch.dtype | None = None, fast=None) -> torch.Tensor:
    """A bitsandbytes layer's weight as the dense tensor its own forward computes with (PEFT's dequantization).

    A 4-bit weight: ``dequantize_4bit``'s values (the forward's kept weight, ``kept_dense``, where ``quant.base`` ran
    it), without PEFT's per-call checks around it, which cost host time every optimizer step (docs/host-notes.md).
    An 8-bit weight: PEFT's float32 values cast to ``dtype`` (default float32).
    ``packed``: a plain alias of the packed weight (``weight.detach()``), if the caller has one. ``fast``: as
    ``dequantize_4bit``."""
    weight = base.weight
    with torch.no_grad():
        kind = type(weight).__name__
        if kind == "Params4bit" and getattr(weight, "quant_state", None) is not None:
            packed = weight.data if packed is None else packed
            out = kept_dense(packed, weight.quant_state)  # the layer's forward has just dequantized it
            return dequantize_4bit(packed, weight.quant_state, fast) if out is None else out
        if kind == "Int8Params":
            out = _dequantize_int8(base, weight.data if packed is None else packed, dtype or torch.float32)
            if out is not None:
                return out
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(base)


def dequantize_4bit(packed: torch.Tensor, state, fast=None) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit(packed, state)``: ``fast.dequantize_4bit`` (``native.bridge``: the
    same bits from C++) where ``fast`` is given and takes the call, else that function itself."""
    out = None if fast is None else fast.dequantize_4bit(packed, state)
    if out is None:
        import bitsandbytes as bnb

        out = bnb.functional.dequantize_4bit(packed, state)
    return out


_INT8_SCALE = 7.874015718698502e-3  # 1 / 127, as bitsandbytes' int8_vectorwise_dequant writes it
_INT8_CHUNK = 16 * 1024 * 1024  # float32 elements of one row chunk's transient (64 MiB)


def _dequantize_int8(base, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """An ``Int8Params`` weight ``CB * SCB / 127`` in ``dtype`` (bitsandbytes' ``int8_vectorwise_dequant`` values,
    same order), or ``None`` (not quantized: PEFT's function). One Triton kernel for a 16-bit ``dtype``, else a row
    chunk at a time (no float32 ``[d_out, d_in]`` tensor); ``SCB`` is read, never written (PEFT's CPU path writes)."""
    state = getattr(base, "state", None)
    scb = getattr(state, "SCB", None)
    scb = getattr(base.weight, "SCB", None) if scb is None else scb
    if data.dtype != torch.int8 or data.dim() != 2 or scb is None:
        return None
    scb = scb.to(data.device)
    if backend.use_triton(data):
        from flashdora.kernels import dequant

        if dequant.takes(data, scb, dtype):
            return dequant.int8_to(data, scb, dtype, _INT8_SCALE)
    scb = scb.view(-1, 1)
    if dtype == torch.float32:
        return data * scb * _INT8_SCALE
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    rows = max(1, _INT8_CHUNK // max(1, data.shape[1]))
    for i in range(0, data.shape[0], rows):
        torch.mul(data[i : i + rows] * scb[i : i + rows], _INT8_SCALE, out=out[i : i + rows])
    return out


def keep_dense(packed, state, fast=None) -> torch.Tensor:
    """The dense weight (``dequantize_4bit``), kept for the layer's norm-cache miss (``kept_dense``)."""
    global _dense
    w = dequantize_4bit(packed, state, fast)
    _dense = (packed.data_ptr(), packed._version, state, w)
    return w


def kept_dense(packed: torch.Tensor, state) -> torch.Tensor | None:
    """The dense weight the last ``quant.base.run`` dequantized, if it is ``packed``'s under ``state`` at its
    version now."""
    got = _dense
    if got is None or got[2] is not state or got[0] != packed.data_ptr() or got[1] != packed._version:
        return None
    return got[3]


def release() -> None:
    """Drop the kept dense weight (the end of a layer's call)."""
    global _dense
    _dense = None
