"""The norm cache on CUDA streams and inside CUDA graphs (``ops/cache_streams.py``): a norm made on one stream is
waited for on another; a captured graph (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) computes
the norm inside itself, so each replay sees the weights as they are then, and the cache keeps nothing from a graph's
memory pool; the default-mode ``torch.compile`` keeps its cache. All of it needs CUDA (``pytest -m gpu``).
"""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import flashdora
from flashdora.tools.demo import build_peft_model
from tests.helpers import rel_err
from tests.ops.test_norm_cache import _ids

pytestmark = pytest.mark.gpu

N_LAYERS = 14  # tiny Llama: 2 layers x 7 projections


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _llama(dtype=torch.float32):
    model = build_peft_model("tiny", 4, 0.0, "cuda", seed=6)
    model.base_model.model.config.use_cache = False
    if dtype != torch.float32:  # PEFT's default on a 16-bit model: fp32 adapters on the 16-bit base
        model.base_model.model.to(dtype)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return model


def _lora_weights(model, name):
    return [p for n, p in model.named_parameters() if f"{name}.default.weight" in n]


def _mlp_pair():
    """A two-layer MLP with DoRA on both layers (capture-safe end to end), enabled, and its PEFT twin."""
    torch.manual_seed(8)
    base = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48)).cuda()
    lora = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["0", "2"], init_lora_weights=False)
    twin = get_peft_model(base, lora)
    return flashdora.enable(copy.deepcopy(twin)), twin


@pytest.mark.parametrize("made_on_side", [True, False], ids=["side-to-default", "default-to-side"])
def test_a_norm_made_on_one_stream_is_waited_for_on_another(made_on_side):
    """The miss runs on one stream behind slow work; the hit on another, without any synchronisation by the user,
    must not read the norm before it is written (poisoned memory shows it if it does)."""
    model, _ = _mlp_pair()
    model.eval()
    x = torch.randn(16, 64, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()
    producer, consumer = (side, torch.cuda.current_stream()) if made_on_side else (torch.cuda.current_stream(), side)
    with torch.no_grad():
        fresh = model(x)  # also tunes the kernels now: no host synchronisation in the misses below
        model(x)
        flashdora.invalidate(model)
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            poison = [torch.full((4096,), float("nan"), device="cuda") for _ in range(256)]
            del poison  # the producer's next small blocks hold NaN
            for _ in range(20):  # the norm lands well after the other stream's forward is queued
                big = big @ big / 64
            model(x)  # misses: the norms are made on the producer stream
        flashdora.reset_stats()
        with torch.cuda.stream(consumer):
            out = model(x)  # hits
        assert flashdora.stats().get("norm:cached") == 2, flashdora.stats()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fresh, rtol=1e-6, atol=1e-6)


def _assert_three_way(replayed, model, twin, x, what):
    with torch.no_grad():
        eager = model(x)
        peft_out = twin(x)
    assert rel_err(replayed, eager) <= 1e-6, f"replay vs eager, {what}"
    assert rel_err(replayed, peft_out) <= 1e-5, f"replay vs PEFT, {what}"


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_a_captured_graph_replays_the_norm_of_the_current_weights(fused):
    model, twin = _mlp_pair()
    model.eval(), twin.eval()
    x = torch.randn(16, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):  # warm-up: autotuning, and the cache fills outside the graph
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = model(x)

    def replay():
        graph.replay()
        torch.cuda.synchronize()
        return static_out.clone()

    first = replay()
    _assert_three_way(first, model, twin, x, "at capture")
    with torch.no_grad():  # in place: the addresses the graph reads stay
        for m in (model, twin):
            for b in _lora_weights(m, "lora_B"):
                b.mul_(1.5)
    edited = replay()
    assert rel_err(edited, first) > 1e-3  # the edit shows, so a stale norm would too
    _assert_three_way(edited, model, twin, x, "after an in-place edit of lora_B")
    for m in (model, twin):
        m.train()
        params = [p for p in m.parameters() if p.requires_grad]
        m(x).square().mean().backward()
        torch.optim.AdamW(params, lr=0.05, fused=fused).step()
        m.zero_grad(set_to_none=True)
        m.eval()
    stepped = replay()
    assert rel_err(stepped, edited) > 1e-3
    _assert_three_way(stepped, model, twin, x, "after an AdamW step")


def _bf16_pair():
    twin = _llama(torch.bfloat16)
    return flashdora.enable(copy.deepcopy(twin)), twin


def test_reduce_overhead_compile_inference_tracks_the_weights():
    """CUDA graph trees: warm-up, recording and replays, then a replay after an in-place edit, against PEFT."""
    model, twin = _bf16_pair()
    model.eval(), twin.eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    ids = _ids(1).cuda()
    for call in range(4):
        if call == 3:
            with torch.no_grad():
                for m in (model, twin):
                    for b in _lora_weights(m, "lora_B"):
                        b.mul_(1.5)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(input_ids=ids).logits.clone()
            peft_out = twin(input_ids=ids).logits
        assert rel_err(out, peft_out) <= 2e-2, f"call {call}"


def test_reduce_overhead_compile_trains_like_peft():
    """At every step PEFT's bf16 twin and a float64 copy load the model's weights; the compiled training step's loss
    and gradients are no further from the float64 ones than PEFT's own bf16 step is (at most 2x, flash-attention's
    rule), so bf16 noise sets the bar; fused AdamW steps the model between (a replay that kept an old norm would be
    off by far more)."""
    model, twin = _bf16_pair()
    ref = copy.deepcopy(twin).double()
    model.train(), twin.train(), ref.train()
    compiled = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, fused=True)
    for step in range(4):
        twin.load_state_dict(model.state_dict()), ref.load_state_dict(model.state_dict())
        ids = _ids(20 + step).cuda()
        losses, grads = [], []
        for fn, m, autocast in ((compiled, model, True), (twin, twin, True), (ref, ref, False)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach().double().item())
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[2].keys() and any("magnitude" in n for n in grads[0])
        assert abs(losses[0] - losses[2]) <= 2 * abs(losses[1] - losses[2]) + 1e-4 * abs(losses[2]), (step, losses)
        names = sorted(grads[2])
        every = [torch.cat([g[n].flatten().double() for n in names]) for g in grads]
        assert rel_err(every[0], every[2]) <= 2 * rel_err(every[1], every[2]) + 1e-3, step
        opt.step()
        for m in (model, twin, ref):
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("private", ["1", "0"])
def test_default_compile_keeps_its_cache(private, monkeypatch):
    """Without reduce-overhead the compiled op caches as the eager path does: one norm per layer in all, also once
    cudagraph trees have been imported (a process that used them elsewhere; without private APIs the op cannot tell
    their warm-up apart and stores nothing, computing each call: correct, slower)."""
    import torch._inductor.cudagraph_trees  # noqa: F401

    monkeypatch.setenv("FLASHDORA_PRIVATE_APIS", private)
    model = flashdora.enable(_llama()).eval()
    compiled = torch.compile(model)
    flashdora.reset_stats()
    with torch.no_grad():
        for seed in range(4):
            out = compiled(input_ids=_ids(seed).cuda()).logits
    computed = flashdora.stats().get("norm:triton", 0)
    assert computed == (N_LAYERS if private == "1" else 4 * N_LAYERS), flashdora.stats()
    with torch.no_grad():
        assert rel_err(out, model(input_ids=_ids(3).cuda()).logits) <= 1e-5
