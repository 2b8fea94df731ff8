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
  bitsandbytes layer's own call), ``bnb`` (``quant.base``: bitsandbytes' ops without its Python), ``native`` (a plain
  ``nn.Linear``'s matmul inside the C++ layer call, with the LoRA A matmul and the compose: ``fused_route``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashdora import backend, config
from flashdora.native import bridge, build
from flashdora.peft.support import hooked_adapter, is_bnb, params_reason, reason
from flashdora.quant import base as bnb_base

COMPOSE = (
    "peft", "meta", "traced", "eager", "triton", "native", "double-eager", "double-triton",
    "mixed-eager", "mixed-triton", "mixed-traced",
)  # fmt: skip
NORM = ("-", "eager", "triton", "native")
BASE = ("module", "layer", "bnb", "native")


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


class RouteRow(NamedTuple):
    """One row of the route table: every ``(compose, norm, base)`` in the product of its cells is a route."""

    compose: tuple[str, ...]
    norm: tuple[str, ...]
    base: tuple[str, ...]
    when: str
    why: str
    measured: str


_ALL_BASES, _PLAIN_BASES = ("module", "layer", "bnb"), ("module", "layer")
MEASURED_LAYER = (
    "8B training step 0.92x PEFT LoRA's against 0.99x with it off (16 layers, r = 16, 1 x 2048), 0.99x against "
    "1.11x at r = 384 (two H100s; docs/benchmarks.md, \"The host\")"
)
# The route table: docs/design.md's "Routes" is ``route_table()`` (tests/test_routes.py checks both, and that the
# routes the functions below can produce are exactly these).
ROUTES = (
    RouteRow(
        ("native",), ("native",), _ALL_BASES,
        "CUDA, Triton, `native` on and the C++ extension loaded (`native_for`: built at the first call that trains, "
        "or found built), no bias with dropout's exact form, no trainable bias (a call the C++ side declines for a "
        "fixed property, such as alignment, runs the Triton path's code every time)",
        "host time per layer call",
        "8B training step 0.80x the `triton` route's at r = 16, fixed length, and 0.84x with a new token count every "
        "step (one H200; docs/benchmarks.md, \"The C++ extension: whole-model A/B\")",
    ),
    RouteRow(
        ("native",), ("native",), ("native",),
        "as the row above, on a plain `nn.Linear` base where nothing a user could see is skipped by not calling "
        "it: no hook on it or process-wide (so no process group: flashdora's FSDP2 watch is one), no torch function "
        "mode, its weight and bias frozen, no dropout in training, `x` and the weight already in the matmul dtype "
        "(`peft.support.plain_base`); a call the C++ side declines runs `native/native/module`",
        "host time per layer call: the base matmul, the LoRA A matmul and the compose in one C++ call, the whole "
        "backward in one autograd node (`native/csrc/layer.cpp`)",
        MEASURED_LAYER,
    ),
    RouteRow(
        ("triton",), ("triton",), _ALL_BASES,
        "CUDA with `native` off, the extension's build failed, or not built yet in a process that has not trained "
        "(inference uses it only once built), an untested torch or Triton, a bias with dropout's exact form or a "
        "trainable bias; the CPU under `TRITON_INTERPRET=1` with `backend=\"triton\"`",
        "fused compose and norm kernels: memory-bound work in single passes",
        "8B inference at r = 384: 0.87x PEFT LoRA's time (docs/benchmarks.md, \"Routes: whole-model measurements\"); "
        "every `bench model` table against PEFT LoRA and DoRA",
    ),
    RouteRow(
        ("eager",), ("eager",), _ALL_BASES,
        "the CPU, float64, `backend=\"eager\"`, CUDA tensors off the current device; `bnb` only where tests add the "
        "CPU to `quant.base.DEVICES`",
        "the exact reference path, and the CPU", "none (correctness; no speed claim)",
    ),
    RouteRow(
        ("eager",), ("triton", "native"), _ALL_BASES,
        "a float64 input on float32 weights and adapters where their norm runs Triton (`backend=\"triton\"`, or CUDA)",
        "keeps float64 inputs exact (the compose in float64; the norm, of float32 weights, in float32)", "none",
    ),
    RouteRow(
        ("traced",), ("triton", "eager"), ("module",),
        "inside `torch.compile` (`triton` norm on CUDA); a bitsandbytes base under compile runs PEFT's forward",
        "no graph break: inductor fuses the compose; the norm is one opaque custom op over the cache",
        "none yet; the alternative is PEFT's ops under compile",
    ),
    RouteRow(
        ("double-eager",), ("eager", "triton", "native"), _ALL_BASES,
        "a forward with grad under `flashdora.double_backward()` where the compose runs eager (the norm as for "
        "`eager`, or a float64 input's)",
        "PEFT's second-order gradients (`create_graph=True`): the compose returns `inner` as a second output",
        "none: opt-in; first-order forwards never take it",
    ),
    RouteRow(
        ("double-triton",), ("triton", "native"), _ALL_BASES,
        "the same where the compose runs Triton", "the same", "none: opt-in",
    ),
    RouteRow(
        ("mixed-triton",), ("triton", "native"), _PLAIN_BASES,
        "a call with PEFT's `adapter_names` on CUDA (eval mode, no gradients): every named adapter of the layer in "
        "one pack, `u = x A_all^T`, then one Triton launch (`kernels/mixed.py`)",
        "several adapters (DoRA and LoRA) in one batch at about one adapter's cost",
        "`flashdora bench serve` (README, \"Serving several adapters\")",
    ),
    RouteRow(
        ("mixed-eager",), ("eager",), _PLAIN_BASES, "the same on the CPU or float64",
        "the exact reference of the mixed path, and the CPU", "none",
    ),
    RouteRow(
        ("mixed-traced",), ("triton", "eager"), _PLAIN_BASES,
        "the same inside `torch.compile` (the pack and the scales built in the graph)",
        "`generate` with a static cache under `mode=\"reduce-overhead\"`", "none",
    ),
    RouteRow(
        ("peft",), ("-",), _ALL_BASES,
        "`why`: `mixed-batch:<why>` (a mixed batch in training mode or with gradients, hooks, extra arguments: PEFT's "
        "sub-batch loop, each DoRA adapter on its single-adapter route), hooks on the adapter modules or "
        "process-wide, DeepSpeed ZeRO-3 on an untested DeepSpeed, a parameter not gathered or a `Conv1D` base, "
        "`torch.func`, a LoRA bias, other base layers or quantizers, adapters on other devices, an input on another "
        "device, bitsandbytes under `torch.compile`, an untested PEFT",
        "whatever PEFT honours, flashdora honours", "PEFT's own",
    ),
    RouteRow(("meta",), ("-",), _PLAIN_BASES, "meta tensors (shapes only)", "meta-device initialisation", "n/a"),
)  # fmt: skip


def routes() -> set[tuple[str, str, str]]:
    """Every ``(compose, norm, base)`` the table lists."""
    return {(c, n, b) for row in ROUTES for c in row.compose for n in row.norm for b in row.base}


def route_table() -> str:
    """docs/design.md's route table, from ``ROUTES``."""
    cell = lambda values: ", ".join(f"`{v}`" for v in values)  # noqa: E731
    lines = [
        "| compose | norm | base | when | why it exists | whole-model measurement |",
        "|---|---|---|---|---|---|",
    ]
    for row in ROUTES:
        lines.append(f"| {cell(row.compose)} | {cell(row.norm)} | {cell(row.base)} | {row.when} | {row.why} | "
                     f"{row.measured} |")  # fmt: skip
    return "\n".join(lines)
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
    on = d["_flashdora_native"] = native_loaded(x, torch.is_grad_enabled() or layer.training)
    return on


def native_loaded(x, trains: bool | None = None) -> bool:
    """``native_for`` for calls outside a PEFT layer (``dora_linear``, the mixed compose's norm): the extension
    where it is on and already loaded, or where a call that trains (``None``: grad on) loads it."""
    if not config.native_on or not x.is_cuda:
        return False
    trains = torch.is_grad_enabled() if trains is None else trains
    return build._module is not None or build.load(trains) is not None


def compose_impl(
    result: torch.Tensor, bias=None, has_lx_base: bool = False, native: bool | None = None, exact: bool = False
) -> str:
    """``eager``, ``triton`` or ``native`` for an eager compose producing ``result``. The C++ side takes no bias with
    dropout's ``lx_base`` (PEFT's exact form never passes both) and no trainable bias. ``native``: ``native_for``'s
    answer for the call (``None``: ``native_loaded``); ``exact``: a float64 adapter tensor (eager, as the norm)."""
    triton = not exact and backend.use_triton(result)
    if config.double_backward and torch.is_grad_enabled():  # (flashdora.double_backward: ops/compose_grad2.py)
        return "double-triton" if triton else "double-eager"
    if not triton:
        return "eager"
    if bias is not None and (has_lx_base or bias.requires_grad):
        return "triton"
    if native is None:
        native = native_loaded(result)
    return "native" if native else "triton"


def base_plan(base, x, native: bool) -> tuple | None:
    """The base implementation of this call of a bitsandbytes layer, decided once, before it runs: bitsandbytes' ops
    from flashdora (``quant.base.plan``; the 4-bit weight dequantized from C++ on the ``native`` route) or ``None``,
    the layer's own call. The route records which ran (``bnb`` or ``layer``)."""
    return bnb_base.plan(base, x, dequantizer(native))


def dequantizer(native: bool):
    """What a bitsandbytes 4-bit weight is dequantized with on a call whose route is (``native``) or is not the C++
    one: ``native.bridge`` (bitsandbytes' kernels launched from C++, the same bits), else ``None`` (bitsandbytes'
    Python function). ``quant`` takes it as an argument and never imports the extension."""
    return bridge if native else None


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
    why = reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude) or params_reason(module._modules, adapter)
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


def _record(module, adapters, route: Route) -> Route:
    """``route``, recorded as the last route of each of ``module``'s ``adapters`` (``last_route``, ``report()``)."""
    routes = module.__dict__.get("_flashdora_routes")
    if routes is None:
        routes = module.__dict__["_flashdora_routes"] = {}
    for adapter in adapters:
        routes[adapter] = route
    return route


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
        exact = _F64 in (lora_A.dtype, lora_B.dtype, magnitude.dtype)
        compose = compose_impl(result, bias, has_lx_base, native, exact)
        route = _route(compose, norm_impl(weight, lora_A, lora_B, magnitude, quantized, compose, native), base_kind)
    return _record(module, (adapter,), route)


def fused_route(module, adapter, base, weight, lora_A, lora_B_layer, lora_B, magnitude, x, bias) -> Route | None:
    """The route of a plain call whose base layer ``peft.support.plain_base`` lets run inside the C++ layer call
    (``native_for`` said yes): ``native/native/native`` where ``layer_route`` would give the call the ``native``
    compose and norm, else ``None``, recording nothing (the caller runs the base layer, then ``layer_route``)."""
    if torch.compiler.is_compiling() or x.is_meta or weight.is_meta:
        return None
    if fallback_reason(base, weight, lora_A, lora_B_layer, lora_B, magnitude, module, adapter, x, x) is not None:
        return None
    if _F64 in (weight.dtype, lora_A.dtype, lora_B.dtype, magnitude.dtype):
        return None
    if compose_impl(x, bias, False, True) != "native":
        return None
    route = _route("native", "native", "native")
    return _record(module, (adapter,), route)


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
    return _record(module, adapters, route)


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
    compose = compose_impl(result, bias, has_lx_base, exact=_F64 in (lora_A.dtype, lora_B.dtype, magnitude.dtype))
    return _route(compose, norm_impl(weight, lora_A, lora_B, magnitude, compose=compose), "module")


def last_route(module, adapter: str) -> Route | None:
    """The route ``module``'s ``adapter`` took at its last call (``None``: not run yet)."""
    return module.__dict__.get("_flashdora_routes", {}).get(adapter)


def explain(module, adapter: str) -> str:
    """``report()``'s route column: ``compose/norm/base`` of the last call (``dispatch.COMPOSE``, ``NORM``,
    ``BASE``), ``peft:<why>``, or ``not run``."""
    route = last_route(module, adapter)
    return "not run" if route is None else str(route)
