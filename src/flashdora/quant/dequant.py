"""A bitsandbytes layer's weight as a dense tensor: PEFT's dequantization, and the dense weight a forward holds.

``dequantized`` is what a norm-cache miss on a bitsandbytes base reads: a 4-bit weight dequantized by bitsandbytes'
own kernels (launched from C++ on CUDA where the extension is built and the bitsandbytes version was tested:
``native.bridge.takes_4bit``), an 8-bit one by one Triton kernel or a row chunk at a time. Where ``quant.base.result`` computed the
layer's base result itself, the 4-bit weight its forward dequantized is kept here (``keep_dense``) until the layer's call
ends (``release``), and the miss takes it (``kept_dense``) instead of dequantizing again.
"""

from __future__ import annotations

import torch

from flashdora import backend, config
from flashdora.config import bnb_tested  # noqa: F401 (quant.base asks it here)
from flashdora.native import bridge

_dense: tuple | None = None  # (packed's data_ptr, its version, quant_state, dense weight) of the last forward


def dequantized(base, packed: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A bitsandbytes layer's weight as the dense tensor its own forward computes with (PEFT's dequantization).

    A 4-bit weight is what ``bitsandbytes.functional.dequantize_4bit`` makes of it, the call PEFT's
    ``dequantize_module_weight`` makes for it (and ``Linear4bit``'s forward), without PEFT's checks around it: a
    cache miss runs this every optimizer step, and those checks read ``Params4bit`` attributes through its
    ``__torch_function__`` (about 60 us of the host's time per call on the dev machine's CPU). On CUDA, with the C++
    extension built and a bitsandbytes version it was tested with, the same kernels of bitsandbytes' library run from
    C++ (``native.bridge.dequantize_4bit``: the same bits, a fraction of the host time); where flashdora computed the
    layer's base result itself (``quant.base``), the weight that forward dequantized (``kept_dense``). An 8-bit weight comes
    in ``dtype`` (default float32), the values of PEFT's float32 dequantization cast to it (``_dequantize_int8``).
    ``packed``: a plain alias of the packed weight (``weight.detach()``), if the caller has one."""
    weight = base.weight
    with torch.no_grad():
        kind = type(weight).__name__
        if kind == "Params4bit" and getattr(weight, "quant_state", None) is not None:
            packed = weight.data if packed is None else packed
            out = kept_dense(packed, weight.quant_state)  # the layer's forward has just dequantized it
            return dequantize_4bit(packed, weight.quant_state) if out is None else out
        if kind == "Int8Params":
            out = _dequantize_int8(base, weight.data if packed is None else packed, dtype or torch.float32)
            if out is not None:
                return out
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(base)


def dequantize_4bit(packed: torch.Tensor, state) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit(packed, state)``: from C++ where ``_native_dequantize_4bit`` runs
    (the same bits), else that function itself."""
    out = bridge.dequantize_4bit(packed, state)
    if out is None:
        import bitsandbytes as bnb

        out = bnb.functional.dequantize_4bit(packed, state)
    return out


_INT8_SCALE = 7.874015718698502e-3  # 1 / 127, as bitsandbytes' int8_vectorwise_dequant writes it
_INT8_CHUNK = 16 * 1024 * 1024  # float32 elements of one row chunk's transient (64 MiB)


def _dequantize_int8(base, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """An ``Int8Params`` weight ``CB * SCB / 127`` in ``dtype``, or ``None`` (not quantized: PEFT's function).

    The values are bitsandbytes' ``int8_vectorwise_dequant(CB, SCB)`` (float32, the weight PEFT's DoRA dequantizes
    and casts to its input's dtype) cast to ``dtype``, computed in the same order. A 16-bit ``dtype`` on the Triton
    path is one kernel (``kernels/dequant.py``: no float32 tensor at all); elsewhere it is filled a row chunk at a
    time, so no float32 ``[d_out, d_in]`` tensor exists, only a chunk of at most 64 MiB. It reads
    ``SCB`` from the layer's state or the parameter without writing either (PEFT's CPU path re-assigns the weight,
    after which bitsandbytes' forward finds no scales)."""
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


def keep_dense(packed, state) -> torch.Tensor:
    """The dense weight (``dequantize_4bit``), kept for the layer's norm-cache miss (``kept_dense``)."""
    global _dense
    w = dequantize_4bit(packed, state)
    _dense = (packed.data_ptr(), packed._version, state, w)
    return w


def kept_dense(packed: torch.Tensor, state) -> torch.Tensor | None:
    """The dense weight the last ``quant.base.result`` dequantized, if it is ``packed``'s under ``state`` at its
    version now."""
    got = _dense
    if got is None or got[2] is not state or got[0] != packed.data_ptr() or got[1] != packed._version:
        return None
    return got[3]


def release() -> None:
    """Drop the kept dense weight (the end of a layer's call)."""
    global _dense
    _dense = None
