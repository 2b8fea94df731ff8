"""``peft.refresh``: a trained layer's norm made right after the optimizer step, read by its next forward, and never
served where the key moved in between (the refresh is then wasted, and its layer dropped).

Each scenario runs the same training with refreshes off (``refresh.ENABLED``) on a model built from the same seed, and
compares every loss bit for bit: a refresh computes what the forward's miss would, with the same code on the same
tensors."""

import pytest
import torch

import flashdora
from flashdora import backend
from flashdora.peft import refresh
from flashdora.tools.demo import build_peft_model

N_LAYERS = 14  # tiny Llama: 2 layers x 7 projections


@pytest.fixture(autouse=True)
def fresh():
    refresh.forget()
    backend._warned.discard("refresh")
    yield
    refresh.forget()
    refresh.ENABLED = True


def _model(checkpointing=None):
    model = build_peft_model("tiny", 4, 0.0, "cpu", seed=4)
    model.base_model.model.config.use_cache = False
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.enable_input_require_grads()
    model.train()
    return flashdora.enable(model)


def _ids():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _norm_stats() -> dict:
    return {k: v for k, v in flashdora.stats().items() if k.startswith("norm")}


def _train(on: bool, steps=4, checkpointing=None, optimizer=None, between=None):
    """Losses, and the norm cache's counts in each step's forward and over each whole step."""
    refresh.ENABLED = on
    model = _model(checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(model) if optimizer else torch.optim.AdamW(params, lr=1e-2)
    ids, losses, forwards, wholes = _ids(), [], [], []
    for step in range(steps):
        flashdora.reset_stats()
        loss = model(input_ids=ids, labels=ids).loss
        forwards.append(_norm_stats())
        loss.backward()
        opt.step()
        opt.zero_grad()
        wholes.append(_norm_stats())
        losses.append(loss.detach())
        if between is not None:
            between(model, step)
    return losses, forwards, wholes


@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["plain", "non-reentrant", "reentrant"])
def test_the_forward_after_a_step_reads_the_norms_made_at_the_step(checkpointing):
    losses, forwards, wholes = _train(True, checkpointing=checkpointing)
    want, off_forwards, _ = _train(False, checkpointing=checkpointing)
    assert all(torch.equal(a, b) for a, b in zip(losses, want)), (losses, want)
    assert forwards[0].get("norm:eager") == N_LAYERS  # the first forward misses: nothing noted before it
    for fwd, whole in zip(forwards[1:], wholes[1:]):
        assert "norm:eager" not in fwd and fwd["norm:cached"] >= N_LAYERS, fwd  # (a recomputation hits too)
        assert whole["norm:refreshed"] == N_LAYERS and whole["norm:eager"] == N_LAYERS, whole
    assert all(f.get("norm:eager") == N_LAYERS for f in off_forwards)  # without refreshes every forward misses
    assert "norm:refreshed" not in _train(False, steps=2)[2][1]


def test_another_optimizers_step_wastes_refreshes_until_the_layers_are_dropped():
    """Two models stepped in turn: each step counts for every trainable tensor (docs/design.md, "Identity model"),
    so each model's refresh is stale by its forward: wasted, never read, dropped at the ``SPARE + 1``-th."""
    refresh.ENABLED = True
    models = [_model(), _model()]
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    ids, losses, stats = _ids(), [], []
    for _ in range(5):
        flashdora.reset_stats()
        for model, opt in zip(models, opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        stats.append(_norm_stats())
    assert refresh.SPARE == 2
    assert stats[0]["norm:refreshed"] == 2 * N_LAYERS and "norm:refresh_wasted" not in stats[0]
    for round_ in stats[1:3]:  # wasted, made again
        assert round_["norm:refresh_wasted"] == round_["norm:refreshed"] == 2 * N_LAYERS, round_
    assert stats[3]["norm:refresh_wasted"] == 2 * N_LAYERS and "norm:refreshed" not in stats[3]  # dropped
    assert stats[4] == {"norm:eager": 2 * N_LAYERS}  # every forward misses, nothing else
    want = _train(False, steps=5)[0]
    assert all(torch.equal(a, b) for a, b in zip(losses[::2], want)) and all(
        torch.equal(a, b) for a, b in zip(losses[1::2], want)
    )


def _write(model, step):
    if step == 1:
        layer = next(m for m in model.modules() if hasattr(m, "lora_magnitude_vector"))
        with torch.no_grad():
            layer.lora_B["default"].weight.mul_(0.5)  # (moves its version: the key)


def test_a_write_between_the_step_and_the_forward_is_seen():
    losses, forwards, wholes = _train(True, between=_write)
    want = _train(False, between=_write)[0]
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    assert forwards[2] == {"norm:eager": 1, "norm:cached": N_LAYERS - 1, "norm:refresh_wasted": 1}  # that layer's
    assert wholes[2]["norm:refreshed"] == N_LAYERS  # (made again)
    assert forwards[3] == {"norm:cached": N_LAYERS}


def test_a_step_inside_the_backward_refreshes_nothing():
    """Optimizer-in-backward: a step per parameter from its gradient hook, while autograd runs."""

    def per_parameter(model):
        opts = {}
        for p in model.parameters():
            if p.requires_grad:
                opts[p] = torch.optim.SGD([p], lr=1e-2)
                p.register_post_accumulate_grad_hook(lambda q: opts[q].step())
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)  # (the loop's own step: no grads)

    losses, forwards, wholes = _train(True, optimizer=per_parameter)
    want = _train(False, optimizer=per_parameter)[0]
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    assert all("norm:refreshed" not in w for w in wholes) and all(f["norm:eager"] == N_LAYERS for f in forwards)


def test_only_the_layers_of_the_stepping_optimizer_are_refreshed():
    def first_layer(model):
        params = [p for n, p in model.named_parameters() if p.requires_grad and ".layers.0." in n]
        return torch.optim.AdamW(params, lr=1e-2)

    losses, forwards, wholes = _train(True, optimizer=first_layer)
    want = _train(False, optimizer=first_layer)[0]
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    assert all(w["norm:refreshed"] == N_LAYERS // 2 for w in wholes)
    assert all(f["norm:eager"] == N_LAYERS // 2 for f in forwards[1:])  # the other layer's still miss (the count)


def test_an_eval_forward_after_a_step_reads_the_refreshed_norms():
    refresh.ENABLED = True
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    flashdora.reset_stats()
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert _norm_stats() == {"norm:cached": N_LAYERS}
    flashdora.invalidate(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, got)  # computed again: the same


def test_a_failing_refresh_warns_once_and_leaves_the_norms_to_the_forward(monkeypatch):
    def broken(*args):
        raise RuntimeError("no memory left")

    monkeypatch.setattr(refresh, "_refresh", broken)
    with pytest.warns(UserWarning, match="norms are computed in the forward from now on .*no memory left"):
        losses, forwards, wholes = _train(True)
    assert all(torch.equal(a, b) for a, b in zip(losses, _train(False)[0]))
    assert all(f["norm:eager"] == N_LAYERS for f in forwards) and all("norm:refreshed" not in w for w in wholes)
