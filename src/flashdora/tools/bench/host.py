"""``flashdora bench model``'s view of the host: a step's GPU kernel time and host gap, and (``--host``) the host
time of a LoRA layer call by phase.

- ``kernel_ms``: the device time of every kernel, copy and fill of one step (``torch.profiler``, one extra untimed
  step). A row's ``host_gap_ms`` is its median wall time minus that: time the GPU waited for the host.
- ``--host``: one more untimed step per mode with timers around the mode's LoRA layer classes' ``forward`` (split
  into the forward and checkpointing's recomputation: a call while autograd runs a backward is a recomputation),
  the backward of the node each layer call returns (flashdora's compose; PEFT LoRA's last op, an add, says little),
  the norm cache's misses (``ops/norm_cache._update``, part of the forward) and the optimizer's ``step`` (the
  per-step work, flashdora's step hook included). Each span but the norm miss starts with the GPU's queue drained
  (``synchronize``, untimed): a host that runs ahead of the GPU otherwise waits inside a launch once the queue is
  full, and that wait would count as host time. So a span is the host's own time (and any sync the call makes).
  The timers cost host time themselves, alike in every mode.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch

from flashdora.tools.bench import timing

PHASES = ("forward", "recompute", "backward", "norm_miss", "optimizer")


def kernel_ms(fn, device) -> float | None:
    """GPU time of one call of ``fn`` in ms (kernels, copies and fills, ``torch.profiler``); ``None`` off CUDA."""
    if not timing.is_cuda(device):
        return None
    from torch.profiler import ProfilerActivity, profile

    timing.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        timing.synchronize(device)
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == cuda) / 1e3


def layer_classes(model) -> list[type]:
    """The classes of ``model``'s LoRA layers (PEFT's ``LoraLayer`` subclasses that hold a ``base_layer``)."""
    from peft.tuners.lora.layer import LoraLayer

    return list({type(m): None for m in model.modules() if isinstance(m, LoraLayer) and hasattr(m, "base_layer")})


def host_phases(model, fn, device) -> dict:
    """One call of ``fn`` (a step on ``model``) with the timers above: per phase, the calls and the median host
    microseconds per call (``optimizer``: per step)."""
    spans: dict[str, list[float]] = defaultdict(list)
    timing.synchronize(device)
    with _timers(model, spans, (lambda: timing.synchronize(device)) if timing.is_cuda(device) else (lambda: None)):
        fn()
    timing.synchronize(device)
    return {
        phase: {"calls": len(spans[phase]), "us": statistics.median(spans[phase]) if spans[phase] else None}
        for phase in PHASES
    }


@contextlib.contextmanager
def _timers(model, spans, drain):
    from flashdora.ops import norm_cache

    restore = []

    def timed_forward(forward):
        def call(self, x, *args, **kwargs):
            phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
            drain()
            t0 = time.perf_counter()
            out = forward(self, x, *args, **kwargs)
            spans[phase].append((time.perf_counter() - t0) * 1e6)
            node = getattr(out, "grad_fn", None)
            if node is not None and phase == "forward" or torch.is_grad_enabled() and phase == "recompute":
                _time_backward(node, spans, drain)
            return out

        return call

    for cls in layer_classes(model):
        restore.append((cls, "forward", cls.__dict__.get("forward")))
        cls.forward = timed_forward(cls.forward)
    update = norm_cache._update

    def timed_update(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return update(*args, **kwargs)
        finally:
            spans["norm_miss"].append((time.perf_counter() - t0) * 1e6)

    norm_cache._update = timed_update
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    started: list[float] = []
    pre = register_optimizer_step_pre_hook(lambda *a: drain() or started.append(time.perf_counter()))
    post = register_optimizer_step_post_hook(
        lambda *a: spans["optimizer"].append((time.perf_counter() - started.pop()) * 1e6) if started else None
    )
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        norm_cache._update = update
        for cls, name, value in restore:
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)


def _time_backward(node, spans, drain) -> None:
    """The host time of ``node``'s backward into ``spans["backward"]`` (a pre-hook starts it, a hook ends it)."""
    if node is None:
        return
    t: list[float] = []
    node.register_prehook(lambda grads: drain() or t.append(time.perf_counter()))
    node.register_hook(
        lambda grad_inputs, grad_outputs: spans["backward"].append((time.perf_counter() - t.pop()) * 1e6) if t else None
    )


def view(model, fn, phase: str, args, device, ms: float | None = None) -> dict:
    """A row's ``kernel_ms`` (per generated token in ``decode``) and, with ``ms`` (the row's median), its
    ``host_gap_ms``; with ``--host``, ``host``: ``host_phases`` (not in ``decode``)."""
    per = args.new_tokens if phase == "decode" else 1
    k = kernel_ms(fn, device)
    out = {"kernel_ms": None if k is None else k / per}
    if ms is not None and k is not None:
        out["host_gap_ms"] = ms - k / per
    if getattr(args, "host", False) and phase != "decode":
        out["host"] = host_phases(model, fn, device)
    return out


def gap(row: dict) -> dict:
    """``host_gap_ms`` of a row whose ``ms`` and ``kernel_ms`` are known (else nothing)."""
    if row.get("ms") is None or row.get("kernel_ms") is None:
        return {}
    return {"host_gap_ms": row["ms"] - row["kernel_ms"]}
