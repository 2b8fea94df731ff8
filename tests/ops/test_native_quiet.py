"""Quiet points (``flashdora.native.adopt``): where the C++ extension is adopted and launch plans found mid-step are
filed. A checkpointed forward and its recomputation must hang the same autograd node, so nothing that decides it may
change between them. CPU: the extension and the kernels stand in."""

import types

import torch
import torch.nn.functional as F

from flashdora import native, native_bridge
from flashdora.ops import compose as C
from flashdora.ops import compose_fn
from flashdora.ops.norm import fresh
from tests.ops.test_native import _layer


def test_a_backward_plan_is_used_from_the_next_quiet_point_on(monkeypatch):
    """A backward kernel compiles in the middle of a step (the first backward of a shape). A forward before that
    hangs the Python path's node; its checkpoint recomputation comes after, and must hang the same node (it saves
    other tensors than the C++ one: a CheckpointError). So a plan found mid-step is filed at the next quiet point
    (``native.adopt``: an optimizer step, a call without grad), and ``compose_with_node`` uses that kernel's plans
    only from then on."""
    plan = (1, 4, 0, 64, 1, 1, "types", [])
    log = []
    fake = types.SimpleNamespace(
        register_backward=lambda *args, **kwargs: log.append("filed"),
        attach=lambda *args, **kwargs: log.append("attached"),
    )
    kernels = types.SimpleNamespace(
        bwd_plan=lambda *args: plan, compose_fwd_fused=lambda result, *args, **kwargs: (result + 1, result + 2)
    )
    monkeypatch.setattr(compose_fn, "_kc", kernels)
    monkeypatch.setattr(native, "_adopted", fake)
    monkeypatch.setattr(native, "_at_quiet", [])
    monkeypatch.setattr(native_bridge, "_published", set())
    monkeypatch.setattr(native_bridge, "_queued", set())
    monkeypatch.setattr(native_bridge, "_filed", {})
    result, a = torch.randn(2, 3, 8), torch.randn(2, 3, 4)
    lora_B, magnitude, scales = torch.randn(8, 4), torch.ones(8, requires_grad=True), torch.ones(3, 8)

    def call():
        return native_bridge.compose_with_node(result, a, None, lora_B, scales, 1.0, magnitude, torch.float32)

    assert call() is None and call() is None  # the forward and its recomputation: the Python path's node both
    assert log == [] and len(native._at_quiet) == 1  # the kernel waits for a quiet point
    native.adopt()
    assert log == [] and native._at_quiet == []
    y = call()  # the C++ node at once; the plan goes to the C++ forward at the next quiet point
    assert log == ["attached"] and torch.equal(y, result + 1) and len(native._at_quiet) == 1
    other = (1, 4, 0, 64, 1, 2, "types", [])  # another token count, the same kernel: its node at once too
    kernels.bwd_plan = lambda *args: other
    call()
    assert log == ["attached", "attached"] and len(native._at_quiet) == 2
    native.adopt()
    assert log == ["attached", "attached", "filed", "filed"] and native._at_quiet == []


def test_no_quiet_point_while_a_backward_may_be_ahead(monkeypatch):
    """A filing waits while a forward with grad may still have its backward or checkpoint recomputation ahead: a
    call without grad after it (an evaluation, a reference model's forward in a training step) is no quiet point,
    nor is an optimizer step taken inside a backward (an optimizer step in the backward); the next step outside a
    backward is one. (CPU: the compose marks the forward; the queue holds a stand-in filing.)"""
    ran = []
    monkeypatch.setattr(native, "_at_quiet", [lambda: ran.append(1)])
    monkeypatch.setattr(native, "_busy", False)
    x, w, lora_A, lora_B, mag = _layer("cpu", torch.float32, torch.float32, 3, 8, 16, 2)
    scales = fresh(w, lora_A.detach(), lora_B.detach(), mag.detach(), 1.0, "eager")[1]
    C.compose_eager(F.linear(x, w), x, lora_A, lora_B, mag, scales, 1.0)  # with grad: its backward is ahead
    assert native._busy
    with torch.no_grad():
        native.adopt_without_grad()
    assert ran == [] and len(native._at_quiet) == 1

    class StepInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            native._after_step(None, (), {})
            return g

    StepInBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert ran == [] and native._busy
    native._after_step(None, (), {})
    assert ran == [1] and native._at_quiet == [] and not native._busy
    native.when_quiet(lambda: ran.append(2))
    with torch.no_grad():  # after the step, a call without grad is a quiet point
        native.adopt_without_grad()
    assert ran == [1, 2]
