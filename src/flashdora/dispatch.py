"""The one place a DoRA layer call is routed.

``layer_route`` decides, once per call of a PEFT DoRA Linear layer, from the settings (``config``) and the call's
state, which code computes it; ``linear_route`` does the same for the public ``dora_linear``. The ``Route`` is
passed down: the compose, the norm cache and the kernels below run what it names and never ask again. ``explain``
gives ``report()`` the route a layer's last call took. docs/design.md, "Routes", lists every route
(tests/test_routes.py and the test session's end check that no other is ever taken: ``SEEN``).

Fields:

- ``compose``: ``peft`` (PEFT's own forward, ``why`` says why), ``meta`` (shapes only: PEFT's ops), ``traced``
  (inside ``torch.compile``: plain torch ops), ``eager``, ``triton``, ``native`` (the C++ forward and node over the
  Triton kernels, ``native_for``; a call the C++ side declines for a fixed property runs the ``triton`` path),
  ``double-eager`` / ``double-triton`` (a forward with grad under ``flashdora.double_backward``: the
  compose that a second backward can go through), ``mixed-eager`` / ``mixed-triton`` / ``mixed-traced`` (a call
  with PEFT's ``adapter_names``: every named adapter in one compose, ``ops.mixed``; ``mixed_route``).
- ``norm``: what a norm-cache miss runs: ``eager``, ``triton``, ``native`` (C++ replay of the Triton launches once
  planned), ``-`` (not flashdora's).
- ``base``: how the base layer's result was made: ``module`` (its own call: ``nn.Linear``, ``Conv1D``), ``layer`` (a
  bitsandbytes layer's own call), ``bnb`` (``quant.base``: bitsandbytes' ops without its Python).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashdora import backend, config
from flashdora.native import build
from flashdora.peft.support import hooked_adapter, is_bnb, reason

COMPOSE = (
    "peft", "meta", "traced", "eager", "triton", "native", "double-eager", "double-triton",
    "mixed-eager", "mixed-triton", "mixed-traced",
)  # fmt: skip
NORM = ("-", "eager", "triton", "native")
BASE = ("module", "layer", "bnb")


class Route(NamedTuple):
    compose: str
    norm: str
    base: str
    why: str | None = None

    def __str__(self) -> str:
        if self.compose == "peft":
            return f"peft:{self.why}"
        return f"{self.compose}/{self.norm}/{self.base}"


_F64 = torch.float64
SEEN: set[tuple[str, str, str]] = set()  # every (compose, norm, base) taken in this process (the route table's test)
_ROUTES: dict[tuple, Route] = {}  # interned routes: one tuple per kind, built once


def _route(compose: str, norm: str, base: str, why: str | None = None) -> Route:
    key = (compose, norm, base, why)
    route = _ROUTES.get(key)
    if route is None:
        route = _ROUTES[key] = Route(compose, norm, base, why)
        SEEN.add((compose, norm, base))
    return route


_graph_task = getattr(torch._C, "_current_graph_task_id", None)  # private: read where ``config.private``


def native_for(layer, x) -> bool:
    """Whether this call of ``layer`` may use the C++ extension (its base, compose and norm), decided once per call.

    A call that trains (grad on, or the layer in training mode: reentrant checkpointing's first forward runs
    without grad) loads the extension, building it first where the cache lacks it; other calls use it only where it
    is already built. A call inside a backward (a checkpoint's recomputation) takes the answer the layer's last call
    outside one took: ``configure(native=...)`` between a forward and its backward changes nothing it saves."""
    if torch.compiler.is_compiling():  # (compiled graphs: plain torch ops, no extension; nothing recorded)
        return False
    d = layer.__dict__
    if "_flashdora_native" in d and config.private and _graph_task is not None and _graph_task() != -1:
        return d["_flashdora_native"]  # inside a backward: the recomputation takes what its forward took
    on = config.native_on and x.is_cuda
    if on and build._module is None:
        on = build.load(torch.is_grad_enabled() or layer.training) is not None
    d["_flashdora_native"] = on
    return on


def native_loaded(x) -> bool:
    """``native_for`` for calls outside a PEFT layer (``dora_linear``, the mixed compose's norm): the extension
    where it is on and already loaded, or where a call with grad loads it."""
    if not config.native_on or not x.is_cuda:
        return False
    return build._module is not None or build.load(torch.is_grad_enabled()) is not None


def compose_impl(result: torch.Tensor, bias=None, has_lx_base: bool = False, native: bool | None = None) -> str:
    """``eager``, ``triton`` or ``native`` for an eager compose producing ``result``. The C++ side takes no bias with
    dropout's ``lx_base`` (PEFT's exact form never passes both) and no trainable bias. ``native``: ``native_for``'s
    answer for the call (``None``: ``native_loaded``)."""
    triton = backend.use_triton(result)
    if config.double_backward and torch.is_grad_enabled():  # (flashdora.double_backward: ops/compose_grad2.py)
        return "double-triton" if triton else "double-eager"
    if not triton:
        return "eager"
    if bias is not None and (has_lx_base or bias.requires_grad):
        return "triton"
    if native is None:
        native = native_loaded(result)
    return "native" if native else "triton"


def norm_impl(
    weight, lora_A, lora_B, magnitude, quantized: bool = False, compose: str | None = None, native: bool | None = None
) -> str:
    """What a norm-cache miss of this layer runs: ``eager``, ``triton`` or ``native``. A dequantized weight is never
    float64: its adapters decide. ``compose``: the call's compose route, when known: a ``triton`` or ``native``
    compose on the same device with no float64 tensor gives the norm the same answer, without the checks."""
    if compose in ("triton", "native") and _F64 not in (weight.dtype, lora_A.dtype, lora_B.dtype, magnitude.dtype):
        return compose
    tensors = (lora_A, lora_B, magnitude) if quantized else (weight, lora_A, lora_B, magnitude)
    if weight.is_meta or not backend.use_triton(*tensors):
        return "eager"
    if native is None:
        native = native_loaded(weight)
    return "native" if native and weight.is_cuda else "triton"


def fallback_reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude, module, adapter, x, result) -> str | None:
    """Why this call runs PEFT's own forward, or ``None``. The order is ``report()``'s
    (``peft.support.unsupported_reason`` gives the static part)."""
    why = reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude)
    if why is None and (hook := hooked_adapter(module, adapter)) is not None:
        why = f"hooks:{hook}"  # PEFT calls these modules; flashdora reads their weights
    if why is None and backend.functorch_active():
        why = "torch.func"  # grad/vmap/jvp: PEFT's plain torch ops compose with every transform
    if why is None and x.device != result.device:
        why = "devices:input"
    if why is None and torch.compiler.is_compiling() and is_bnb(base):
        why = "quantized:compile"
    if why is None and not config.peft_tested():
        why = "peft-version"  # PEFT's private surface (config.TESTED)
    return why


def layer_route(
    module, adapter, base, weight, lora_A, lora_B_layer, lora_B, magnitude, x, result, base_kind, bias, has_lx_base,
    native: bool,
) -> Route:
    """The route of one call of a PEFT DoRA Linear layer's ``adapter`` (after its base layer ran: ``base_kind``;
    ``native``: ``native_for``'s answer for the call)."""
    why = fallback_reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude, module, adapter, x, result)
    if x.is_meta or weight.is_meta:  # shapes only (meta-device initialisation): PEFT's ops, not a fallback
        route = _route("meta", "-", base_kind)
    elif why is not None:
        route = _route("peft", "-", base_kind, why)
    elif torch.compiler.is_compiling():  # (the norm: decided inside the cache's custom op when it runs)
        route = _route("traced", "triton" if result.is_cuda else "eager", base_kind)
    else:
        quantized = base_kind != "module"
        compose = compose_impl(result, bias, has_lx_base, native)
        route = _route(compose, norm_impl(weight, lora_A, lora_B, magnitude, quantized, compose, native), base_kind)
    routes = module.__dict__.get("_flashdora_routes")
    if routes is None:
        routes = module.__dict__["_flashdora_routes"] = {}
    routes[adapter] = route
    return route


def mixed_route(module, adapters, x, base_kind: str, why: str | None) -> Route:
    """The route of a LoRA layer's call with ``adapter_names`` (``peft.mixed``): PEFT's sub-batch loop where
    ``why`` (``peft.mixed.reason``) says so, else the mixed compose, traced inside ``torch.compile``, Triton where
    ``use_triton``, else eager; its norm as a single-adapter call's. Recorded for each of ``adapters``."""
    if why is not None:
        route = _route("peft", "-", base_kind, f"mixed-batch:{why}")
    elif torch.compiler.is_compiling():
        route = _route("mixed-traced", "triton" if x.is_cuda else "eager", base_kind)
    elif backend.use_triton(x):
        route = _route("mixed-triton", "native" if native_loaded(x) else "triton", base_kind)
    else:
        route = _route("mixed-eager", "eager", base_kind)
    routes = module.__dict__.get("_flashdora_routes")
    if routes is None:
        routes = module.__dict__["_flashdora_routes"] = {}
    for adapter in adapters:
        routes[adapter] = route
    return route


def linear_reference_route(x, weight) -> Route | None:
    """The route of a ``dora_linear`` call that takes the plain-torch reference (meta tensors; a ``torch.func``
    transform, with which the reference composes), else ``None``: ``linear_route`` then routes it."""
    if x.is_meta or weight.is_meta:
        return _route("meta", "-", "module")
    if backend.functorch_active():
        return _route("peft", "-", "module", "torch.func")
    return None


def linear_route(x, weight, bias, lora_A, lora_B, magnitude, result, has_lx_base: bool) -> Route:
    """The route of a ``dora_linear`` call that ``linear_reference_route`` left (validated inputs; ``result``:
    ``x W^T + bias``)."""
    if torch.compiler.is_compiling():  # (the norm: decided inside the cache's custom op when it runs)
        return _route("traced", "triton" if x.is_cuda else "eager", "module")
    compose = compose_impl(result, bias, has_lx_base)
    return _route(compose, norm_impl(weight, lora_A, lora_B, magnitude), "module")


def last_route(module, adapter: str) -> Route | None:
    """The route ``module``'s ``adapter`` took at its last call (``None``: not run yet)."""
    return module.__dict__.get("_flashdora_routes", {}).get(adapter)


def explain(module, adapter: str) -> str:
    """``report()``'s route column: ``compose/norm/base`` of the last call (``dispatch.COMPOSE``, ``NORM``,
    ``BASE``), ``peft:<why>``, or ``not run``."""
    route = last_route(module, adapter)
    return "not run" if route is None else str(route)
