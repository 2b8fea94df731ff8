"""The timed step of each ``flashdora bench model`` phase, and the timer of a phase's first (cold) step.

- ``inference``: one forward without grad (eval mode).
- ``grad``: ``--grad-accum`` forward + backward passes, ``.grad`` dropped after; no optimizer. Each step first marks
  the trainable parameters as changed (``increment_version``, as an optimizer step would), so a norm cache
  recomputes once per step.
- ``train``: the passes of ``grad``, then ``AdamW.step()`` and ``zero_grad(set_to_none=True)``: the weights really
  change every step. The optimizer (``lr=1e-5``, ``fused=True`` on CUDA, torch's default elsewhere) is built with
  the step, outside the timing; its state is made by the first step and stays resident for the phase.
- ``decode``: ``generate`` (greedy, KV cache on, exactly ``--new-tokens`` tokens) from a ``[1, --prompt]`` prompt,
  unmerged adapters, eval mode (transformers checkpoints only in training mode).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from flashdora import config
from flashdora.tools.bench import timing

LR = 1e-5
TRAIN_OPTIMIZER = (
    f"torch.optim.AdamW(trainable params, lr={LR:g}, fused=True on CUDA, torch's default elsewhere), built outside "
    "the timing; step() and zero_grad(set_to_none=True) timed"
)


def first_call_timed(fn, device) -> tuple[Callable[[], None], list[float]]:
    """``fn`` wrapped so that its first call is also timed (wall ms, queue drained before and after) into the list."""
    first: list[float] = []

    def call():
        if first:
            fn()
            return
        timing.synchronize(device)
        t0 = time.perf_counter()
        fn()
        timing.synchronize(device)
        first.append((time.perf_counter() - t0) * 1e3)

    return call, first


def decode_prompt(model, args, device) -> torch.Tensor:
    """The ``[1, --prompt]`` prompt of ``decode``: seeded, the same for every mode."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    return torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=gen).to(device)


class Feed:
    """The ``[batch, seq]`` token ids a step function reads at each call (``--dynamic`` sets new ones per step)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids


def _amp(device_type: str, args):
    return torch.autocast(device_type, dtype=torch.bfloat16) if args.dtype == "autocast" else contextlib.nullcontext()


def step_fn(model, ids, phase: str, args):
    """One timed step of ``phase`` on ``model`` (``ids``: ``[batch, seq]`` tokens, or a ``Feed`` read at each call;
    ``decode`` makes its own prompt)."""
    feed = ids if isinstance(ids, Feed) else Feed(ids)
    ids = feed.ids
    device_type = ids.device.type

    def amp():
        return _amp(device_type, args)

    if phase == "decode":
        return _decode_step(model, decode_prompt(model, args, ids.device), args, amp)
    call = torch.compile(model) if args.compile else model
    if phase == "inference":
        model.eval()

        def inference():
            with torch.no_grad(), amp():
                call(input_ids=feed.ids)

        return inference
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def passes():
        for _ in range(args.grad_accum):
            with amp():
                loss = call(input_ids=feed.ids, labels=feed.ids).loss / args.grad_accum
            loss.backward()

    if phase == "train":
        return _train_step(passes, params, ids.device)
    if phase != "grad":
        raise ValueError(f"step_fn: phase expected one of inference, grad, train, decode, got {phase!r}")

    def grad():
        torch.autograd.graph.increment_version(params)  # what an optimizer step does to the weights' versions
        passes()
        for p in params:  # dropped after each step: the baseline excludes gradients, the peak includes them
            p.grad = None

    return grad


def base_pass(model, feed: Feed, args, adapters: bool) -> None:
    """One forward and backward of ``model`` on ``feed``'s ids with its adapters off (``adapters``: a PEFT model),
    nothing kept: ``--dynamic``'s untimed call at a new token count (only the input embeddings need a gradient)."""
    with model.disable_adapter() if adapters else contextlib.nullcontext():  # (the recomputation too: backward inside)
        with _amp(feed.ids.device.type, args):
            loss = model(input_ids=feed.ids, labels=feed.ids).loss
        loss.backward()


def _train_step(passes, params, device):
    """``passes`` then an AdamW step over ``params`` (none for ``base``: its step is the passes alone)."""
    opt = None
    if params:
        fused = True if timing.is_cuda(device) else None
        opt = torch.optim.AdamW(params, lr=LR, fused=fused)

    def train():
        passes()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)  # the baseline excludes gradients, the peak includes them

    return train


def _decode_step(model, prompt, args, amp):
    """Greedy ``generate`` of exactly ``args.new_tokens`` tokens after ``prompt``, the KV cache on."""
    model.eval()
    mask = torch.ones_like(prompt)
    n = args.new_tokens

    def decode():
        with amp():
            out = model.generate(
                input_ids=prompt,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,  # the bench's config says False (training); generate reads it from there
            )
        if out.shape[-1] != prompt.shape[-1] + n:
            raise RuntimeError(f"decode: expected {n} new tokens, got {out.shape[-1] - prompt.shape[-1]}")

    return decode


def phase_row(target, base_row, mode, phase, args) -> dict:
    """The fields of one (mode, phase) row known before it runs: decode's own sizes, train's optimizer size."""
    row = {**base_row, "mode": mode, "phase": phase}
    if phase == "decode":  # batch 1; ``tokens``: generated per step
        row.update(tokens=args.new_tokens, batch=1, seq=args.prompt, prompt=args.prompt, new_tokens=args.new_tokens)
    elif phase == "train":  # 0 for ``base``: no trainable parameters, no optimizer step
        row["optimizer_params"] = sum(p.numel() for p in target.parameters() if p.requires_grad)
    return row


def native_off(off: bool):
    """``configure(native=False)`` inside (``off``), the caller's setting restored after."""
    return config.override(native=False) if off else contextlib.nullcontext()


@contextlib.contextmanager
def _split():
    from flashdora.peft import variant

    before, variant.FUSE = variant.FUSE, False
    try:
        yield
    finally:
        variant.FUSE = before


SWITCHED = ("flashdora_python", "flashdora_split")  # the modes ``mode_switch`` runs under a setting of their own


def mode_switch(mode: str):
    """What a mode's steps run under: ``flashdora_python`` with ``configure(native=False)``; ``flashdora_split`` with
    the C++ layer call off (the base layer called as a module, then the C++ compose: ``peft.variant.FUSE``); the
    caller's settings restored after."""
    if mode == "flashdora_split":
        return _split()
    return native_off(mode == "flashdora_python")
