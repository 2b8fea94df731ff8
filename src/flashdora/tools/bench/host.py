"""``flashdora bench model``'s view of the host: a step's GPU kernel time and host gap, and (``--host``) the host
time of a LoRA layer call by phase.

- ``kernel_ms``: the device time of every kernel, copy and fill of a step (``torch.profiler``), the median of
  ``KERNEL_STEPS`` extra untimed steps (``kernel_ms_steps``: each one's): a step's kernel time moves by about 1% from
  step to step, as much as the host gaps differ at four sequences. A row's ``host_gap_ms`` is its median wall time
  minus that: time the GPU waited for the host.
- ``--host``: one more untimed step per mode with timers around the mode's LoRA layer classes' ``forward`` (split
  into the forward and checkpointing's recomputation: a call while autograd runs a backward is a recomputation),
  the backward of the node each layer call returns (flashdora's compose; PEFT LoRA's last op, an add, says little),
  the norm cache's misses (``ops/norm_cache._update``, part of the forward) and the optimizer's ``step`` (the
  per-step work, flashdora's step hook included). Each span but the norm miss starts with the GPU's queue drained
  (``synchronize``, untimed): a host that runs ahead of the GPU otherwise waits inside a launch once the queue is
  full, and that wait would count as host time. So a span is the host's own time (and any sync the call makes).
  The timers cost host time themselves, alike in every mode. A second step counts the Python-level calls of each
  span instead (``sys.setprofile`` on the span's thread: functions and builtins, torch's ops among them).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import defaultdict

import torch

from flashdora.tools.bench import timing

PHASES = ("forward", "recompute", "backward", "norm_miss", "optimizer")
KERNEL_STEPS = 3  # profiled steps behind a row's kernel_ms (their median)


def kernel_ms(fn, device, by_name: dict | None = None) -> float | None:
    """GPU time of one call of ``fn`` in ms (kernels, copies and fills, ``torch.profiler``); ``None`` off CUDA.
    ``by_name``: a dict to fill with the ms of each kernel (by name) that ran."""
    if not timing.is_cuda(device):
        return None
    from torch.profiler import ProfilerActivity, profile

    timing.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        timing.synchronize(device)
    cuda = torch.autograd.DeviceType.CUDA
    ran = [e for e in prof.key_averages() if e.device_type == cuda]
    if by_name is not None:
        by_name.update((e.key, e.self_device_time_total / 1e3) for e in ran)
    return sum(e.self_device_time_total for e in ran) / 1e3


def layer_classes(model) -> list[type]:
    """The classes of ``model``'s LoRA layers (PEFT's ``LoraLayer`` subclasses that hold a ``base_layer``)."""
    from peft.tuners.lora.layer import LoraLayer

    return list({type(m): None for m in model.modules() if isinstance(m, LoraLayer) and hasattr(m, "base_layer")})


def host_phases(model, fn, device) -> dict:
    """Two calls of ``fn`` (a step on ``model``) with the timers above: per phase, the calls in the step, the median
    host microseconds per call (``optimizer``: per step), and from the second call the median Python-level calls
    per call (``py_calls``: function and builtin calls, ``sys.setprofile``, which slows that step)."""
    drain = (lambda: timing.synchronize(device)) if timing.is_cuda(device) else (lambda: None)
    out: dict[str, dict] = {}
    for key, clock in (("us", _Clock()), ("py_calls", _Clock(count=True))):
        spans: dict[str, list[float]] = defaultdict(list)
        timing.synchronize(device)
        with _timers(model, spans, drain, clock):
            fn()
        timing.synchronize(device)
        for phase in PHASES:
            row = out.setdefault(phase, {"calls": len(spans[phase])})
            row[key] = statistics.median(spans[phase]) if spans[phase] else None
    return out


class _Clock:
    """A span's reading: host microseconds, or (``count``) the Python-level calls made in it on its thread."""

    def __init__(self, count: bool = False):
        self.count, self.n = count, 0
        self.tick = self._tick  # (one bound method: ``sys.getprofile`` hands back this object)

    def _tick(self, frame, event, arg):
        if event == "call" or event == "c_call":
            self.n += 1

    def start(self):
        if not self.count:
            return time.perf_counter(), None
        prev = sys.getprofile()
        if prev is not self.tick:
            sys.setprofile(self.tick)
        return self.n, prev

    def stop(self, started) -> float:
        value, prev = started
        if not self.count:
            return (time.perf_counter() - value) * 1e6
        n = self.n - value
        if prev is not self.tick:
            sys.setprofile(prev)
        return n


@contextlib.contextmanager
def _timers(model, spans, drain, clock):
    from flashdora.ops import norm_cache

    restore = []

    def timed_forward(forward):
        def call(self, x, *args, **kwargs):
            phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
            drain()
            t0 = clock.start()
            try:
                out = forward(self, x, *args, **kwargs)
            except BaseException:  # (checkpointing stops a recomputation early by raising: no span)
                clock.stop(t0)
                raise
            spans[phase].append(clock.stop(t0))
            node = getattr(out, "grad_fn", None)
            if node is not None and phase == "forward" or torch.is_grad_enabled() and phase == "recompute":
                _time_backward(node, spans, drain, clock)
            return out

        return call

    for cls in layer_classes(model):
        restore.append((cls, cls.__dict__.get("forward")))
        cls.forward = timed_forward(cls.forward)
    update = norm_cache._update

    def timed_update(*args, **kwargs):
        t0 = clock.start()
        try:
            return update(*args, **kwargs)
        finally:
            spans["norm_miss"].append(clock.stop(t0))

    norm_cache._update = timed_update
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    started: list = []
    pre = register_optimizer_step_pre_hook(lambda *a: drain() or started.append(clock.start()))
    post = register_optimizer_step_post_hook(
        lambda *a: spans["optimizer"].append(clock.stop(started.pop())) if started else None
    )
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        norm_cache._update = update
        for cls, forward in restore:
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward


def _time_backward(node, spans, drain, clock) -> None:
    """``node``'s backward into ``spans["backward"]`` (a pre-hook starts the span, a hook ends it)."""
    if node is None:
        return
    t: list = []
    node.register_prehook(lambda grads: drain() or t.append(clock.start()))
    node.register_hook(lambda grad_inputs, grad_outputs: spans["backward"].append(clock.stop(t.pop())) if t else None)


def view(model, fn, phase: str, args, device) -> dict:
    """A row's ``kernel_ms``, the median of ``KERNEL_STEPS`` profiled calls of ``fn``, and ``kernel_ms_steps``
    (per generated token in ``decode``; ``gap`` makes its ``host_gap_ms`` once its ``ms`` is known) and, with
    ``--host``, ``host``: ``host_phases`` (not in ``decode``)."""
    per = args.new_tokens if phase == "decode" else 1
    steps = [kernel_ms(fn, device) for _ in range(KERNEL_STEPS if timing.is_cuda(device) else 1)]
    if steps[0] is None:
        out = {"kernel_ms": None}
    else:
        out = {"kernel_ms": statistics.median(steps) / per, "kernel_ms_steps": [k / per for k in steps]}
    if getattr(args, "host", False) and phase != "decode":
        out["host"] = host_phases(model, fn, device)
    return out


def gap(row: dict) -> dict:
    """``host_gap_ms`` of a row whose ``ms`` and ``kernel_ms`` are known (else nothing)."""
    if row.get("ms") is None or row.get("kernel_ms") is None:
        return {}
    return {"host_gap_ms": row["ms"] - row["kernel_ms"]}
