"""``flashdora bench serve``: a batch whose requests use different adapters, PEFT against flashdora in one run.

One base model (a preset or ``--config``, random weights; bf16 on CUDA, float32 on the CPU) is wrapped for each
(K, r) of ``--adapters`` x ``--ranks`` with K LoRA adapters ``lora_0..`` and K DoRA adapters ``dora_0..``
(``LoraConfig(r=r, lora_alpha=2r, target_modules="all-linear", init_lora_weights=False)``, PEFT's default float32
adapters, no autocast), and unloaded after. ``--requests`` rows of random tokens, request i on adapter i % K, the
same for every (K, r). The modes (``serve_render.MODES``):

- ``peft_lora_one``: flashdora off, ``set_adapter("lora_0")``: PEFT LoRA, one adapter for the whole batch (the floor).
- ``peft_lora_mixed``: flashdora off, ``adapter_names=[lora_{i % K}]`` on every forward.
- ``peft_dora_loop``: flashdora off, PEFT DoRA, a sub-batch per adapter run in turn (PEFT refuses ``adapter_names``
  with DoRA); the ``set_adapter("dora_k")`` between sub-batches is inside the timing.
- ``flashdora_mixed``: ``flashdora.enable``, ``adapter_names=[dora_{i % K}]`` on every forward.

Each step runs every mode once, the start rotated step by step, under ``torch.inference_mode()`` in eval mode. A
mode's call: decode (the ``--prompt``-token prefill untimed, then ``--new-tokens`` greedy single-token forwards with
the KV cache, timed as one), then prefill (one ``--prefill-prompt``-token forward, timed). Forwards keep the last
position's logits only (``logits_to_keep=1``), as ``generate`` does. ``flashdora.enable`` clears the norm cache, so
``flashdora_mixed``'s untimed prompt prefill refills it before its timed calls, as in a server that stays enabled.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model

import flashdora
from flashdora.tools.bench import record, timing
from flashdora.tools.bench.model_build import build_config, build_weights
from flashdora.tools.bench.serve_render import MODES, print_table, render_markdown, render_png  # noqa: F401

_FLOOR = "peft_lora_one"


@dataclass
class Group:
    """Requests run in one forward: ``rows`` of the batch, the adapter set before them, their ``adapter_names``."""

    rows: slice | torch.Tensor
    active: str | None
    names: list[str] | None


def plan(mode: str, k: int, requests: int, device) -> list[Group]:
    """The forwards one step of ``mode`` makes for a batch of ``requests`` over ``k`` adapters."""
    if mode == "peft_lora_one":
        return [Group(slice(None), "lora_0", None)]
    if mode == "peft_dora_loop":
        return [Group(torch.arange(a, requests, k, device=device), f"dora_{a}", None) for a in range(k)]
    kind = "lora" if mode == "peft_lora_mixed" else "dora"
    return [Group(slice(None), None, [f"{kind}_{i % k}" for i in range(requests)])]


def build_model(config, args, device) -> torch.nn.Module:
    """The frozen base in eval mode: bf16, float32 on the CPU (no fast bf16 matmuls there)."""
    model = build_weights(config, args, device)
    if device.type == "cpu":
        model.float()
    return model.requires_grad_(False).eval()


def attach(model, k: int, rank: int, seed: int):
    """``model`` wrapped with adapters ``lora_0..lora_{k-1}`` and ``dora_0..dora_{k-1}`` of rank ``rank``."""
    torch.manual_seed(seed)
    peft_model = None
    with torch.device(model.device):  # adapters initialised where they live
        for kind in ("lora", "dora"):
            config = LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules="all-linear",
                use_dora=kind == "dora",
                init_lora_weights=False,
            )  # (False: lora_B random, so the adapters change the outputs)
            for a in range(k):
                if peft_model is None:
                    peft_model = get_peft_model(model, config, adapter_name=f"{kind}_{a}")
                else:
                    peft_model.add_adapter(f"{kind}_{a}", config)
    return peft_model.eval()


def _forward(model, group: Group, ids, cache=None):
    """One forward with the KV cache on: (the greedy next token ``[b, 1]``, the cache)."""
    extra = {} if group.names is None else {"adapter_names": group.names}
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
    return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values


def _log(line: str) -> None:
    print(f"bench serve: {line}", file=sys.stderr, flush=True)


def _gib(params) -> float:
    return sum(p.numel() * p.element_size() for p in params) / timing.GIB


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / timing.GIB if timing.is_cuda(device) else None


def run_mode(model, mode: str, groups: list[Group], prompts, new_tokens: int, device) -> dict:
    """One step of ``mode``: decode and prefill ms, peak memory, the greedy tokens ``[requests, 1 + new_tokens]``
    and the flashdora paths taken."""
    decode_ids, prefill_ids = prompts
    if mode == "flashdora_mixed":
        flashdora.enable(model)
    else:
        flashdora.disable(model)
    switch = len(groups) > 1
    if groups[0].active is not None:
        model.set_adapter(groups[0].active)
    flashdora.reset_stats()
    if timing.is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
    states, tokens = [], []
    for g in groups:  # the prompt's prefill, untimed
        if switch:
            model.set_adapter(g.active)
        states.append(_forward(model, g, decode_ids[g.rows]))
        tokens.append([states[-1][0]])
    peaks = [_peak_gib(device)]

    def decode():
        for g, (token, cache), out in zip(groups, states, tokens):
            if switch:
                model.set_adapter(g.active)
            for _ in range(new_tokens):
                token, cache = _forward(model, g, token, cache)
                out.append(token)

    decode_ms = timing.measure(decode, warmup=0, reps=1, device=device).ms  # (measure resets the peak)
    peaks.append(_peak_gib(device))
    states.clear()  # the KV caches
    parts = [prefill_ids[g.rows] for g in groups]

    def prefill():
        for g, ids in zip(groups, parts):
            if switch:
                model.set_adapter(g.active)
            _forward(model, g, ids)

    prefill_ms = timing.measure(prefill, warmup=0, reps=1, device=device).ms
    peaks.append(_peak_gib(device))
    generated = torch.empty(len(decode_ids), 1 + new_tokens, dtype=torch.long, device=decode_ids.device)
    for g, out in zip(groups, tokens):
        generated[g.rows] = torch.cat(out, dim=1)
    return {
        "decode_ms": decode_ms / new_tokens,
        "prefill_ms": prefill_ms,
        "peak_mem_gib": None if peaks[0] is None else max(peaks),
        "tokens": generated.cpu(),
        "paths": sorted(k for k in flashdora.stats() if not k.startswith("norm")),
    }


def summarize(mode: str, k: int, rank: int, calls: list[dict], error: str | None, requests: int) -> dict:
    """The row of one (K, r, mode): medians over the timed steps, every step's times, the largest peak."""
    row = {"adapters": k, "rank": rank, "mode": mode, "requests": requests}
    if error is not None or not calls:
        return {**row, "prefill_ms": None, "decode_ms_per_token": None, "peak_mem_gib": None, "error": error}
    decode, prefill = [c["decode_ms"] for c in calls], [c["prefill_ms"] for c in calls]
    peaks = [c["peak_mem_gib"] for c in calls if c["peak_mem_gib"] is not None]
    return {
        **row,
        "prefill_ms": statistics.median(prefill),
        "decode_ms_per_token": statistics.median(decode),
        "decode_tokens_per_s": requests * 1e3 / statistics.median(decode),
        "peak_mem_gib": max(peaks) if peaks else None,
        "prefill_times_ms": prefill,
        "decode_times_ms": decode,
        "paths": calls[-1]["paths"],
    }


def add_ratios(rows: list[dict]) -> None:
    """Each row's prefill and decode time over ``peft_lora_one``'s in the same (K, r) (``None`` without it)."""
    floor = next((r for r in rows if r["mode"] == _FLOOR), {})
    for row in rows:
        for key, name in (("prefill_ms", "prefill_vs_lora_one"), ("decode_ms_per_token", "decode_vs_lora_one")):
            base = floor.get(key)
            row[name] = row[key] / base if row[key] is not None and base else None


def token_match(first: dict) -> dict:
    """The share of equal greedy tokens of ``flashdora_mixed`` and ``peft_dora_loop`` in their first step."""
    a, b = first.get("flashdora_mixed"), first.get("peft_dora_loop")
    if a is None or b is None:
        return {"first_token_match": None, "token_match": None}
    equal = a == b
    return {"first_token_match": equal[:, 0].float().mean().item(), "token_match": equal.float().mean().item()}


def _progress(label: str, step: int, args, done: dict, start: float) -> None:
    """One line on stderr per (K, r, step): where the run is, and this step's decode times."""
    kind, n, total = (
        ("warm-up", step + 1, args.warmup) if step < args.warmup else ("rep", step + 1 - args.warmup, args.reps)
    )
    times = ", ".join(f"{m} {c['decode_ms']:.2f}" for m, c in done.items())
    elapsed = time.perf_counter() - start
    _log(f"{label} {kind} {n}/{total}, {elapsed:.0f} s; decode ms/step: {times}")


def run_step(model, step: int, plans: dict, prompts, args, errors: dict, label: str, device) -> dict:
    """Every mode once, the start rotated by ``step``: mode -> its call; a mode that raises goes into ``errors``
    (printed) and is skipped from then on."""
    modes, done = list(plans), {}
    for i in range(len(modes)):
        mode = modes[(step + i) % len(modes)]
        if mode in errors:
            continue
        try:
            done[mode] = run_mode(model, mode, plans[mode], prompts, args.new_tokens, device)
        except Exception as e:  # noqa: BLE001 - recorded in the row and printed; the other modes still run
            timing.free_memory(device)
            errors[mode] = "out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{e!r}"[:300]
            _log(f"{label} {mode} failed: {errors[mode]}")
    return done


def run_combo(model, k: int, rank: int, prompts, args, device, start: float):
    """Every mode of one (K, r), step by step: ``(the unwrapped model, rows, the (K, r)'s summary)``."""
    t0, label = time.perf_counter(), f"K={k} r={rank}"
    peft_model = attach(model, k, rank, args.seed + 1)
    combo = {"adapters": k, "rank": rank, "attach_s": time.perf_counter() - t0}
    combo["adapter_param_gib"] = _gib(p for n, p in peft_model.named_parameters() if "lora_" in n)
    _log(f"{label}: {2 * k} adapters attached in {combo['attach_s']:.1f} s")
    plans = {mode: plan(mode, k, args.requests, device) for mode in args.modes}
    calls, errors, first = {m: [] for m in args.modes}, {}, {}
    try:
        with torch.inference_mode():
            for step in range(args.warmup + args.reps):
                done = run_step(peft_model, step, plans, prompts, args, errors, label, device)
                for mode, call in done.items():
                    first.setdefault(mode, call["tokens"])
                    if step >= args.warmup:
                        calls[mode].append(call)
                _progress(label, step, args, done, start)
    finally:
        flashdora.disable(peft_model)
        model = peft_model.unload()
        del peft_model
        timing.free_memory(device)
    rows = [summarize(m, k, rank, calls[m], errors.get(m), args.requests) for m in args.modes]
    add_ratios(rows)
    return model, rows, {**combo, **token_match(first)}


def protocol(args, device) -> dict:
    """What a step does and how it is timed, for the result JSON."""
    return {
        "warmup": args.warmup,
        "reps": args.reps,
        "statistic": "median",
        "order": "interleaved: each step runs every mode once, the start rotated step by step",
        "timer": "cuda events" if timing.is_cuda(device) else "perf_counter",
        "memory": "max_memory_allocated over the mode's calls in a step (model included), the largest step (GiB)",
        "dtype": "bf16 base, float32 adapters (PEFT's autocast_adapter_dtype), no autocast"
        if device.type != "cpu"
        else "float32 base and adapters",
        "lora": "LoraConfig(r, lora_alpha=2r, target_modules='all-linear', init_lora_weights=False)",
        "requests": args.requests,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "prefill_prompt": args.prefill_prompt,
        "decode": "prompt prefill untimed, then new_tokens greedy single-token forwards with the KV cache, timed as "
        "one; reported per step of the whole batch",
        "prefill": "one forward of prefill_prompt tokens per request, use_cache=True, logits_to_keep=1",
        "exactness": "greedy tokens of flashdora_mixed vs peft_dora_loop in their first step (warm-up included)",
    }


def _inputs(config, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode prompts ``[requests, prompt]`` and prefill prompts ``[requests, prefill_prompt]``: seeded."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    decode = torch.randint(0, config.vocab_size, (args.requests, args.prompt), generator=gen)
    prefill = torch.randint(0, config.vocab_size, (args.requests, args.prefill_prompt), generator=gen)
    return decode.to(device), prefill.to(device)


def run(args) -> int:
    from rich.console import Console

    device = torch.device(args.device)  # options checked by flashdora.tools.cli.check
    name, config = build_config(args)
    config.use_cache = True
    model = build_model(config, args, device)
    prompts = _inputs(config, args, device)
    result = record.new_result("serve", device, protocol(args, device), vars(args))
    fields = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size")  # fmt: skip
    result["config"] = {"name": name, **{k: getattr(config, k, None) for k in fields}}
    result["param_gib"] = _gib(model.parameters())
    rows, combos, start = [], [], time.perf_counter()
    for rank in args.ranks:
        for k in args.adapters:
            model, more, combo = run_combo(model, k, rank, prompts, args, device, start)
            rows += more
            combos.append(combo)
    result["rows"], result["combos"] = rows, combos
    paths = record.write(result, args.out, render_markdown, render_png)
    console = Console(width=None if sys.stdout.isatty() else 140)  # (a log keeps the table's columns whole)
    print_table(result, console)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
