"""``flashdora demo``: a small Llama-style model, a few DoRA training steps with PEFT and with flashdora, one table.

Both runs start from the same weights and see the same batches and dropout masks; the table shows time per step,
peak memory (CUDA), and how far flashdora's losses and final logits are from PEFT's.
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import nullcontext

import torch

import flashdora

# name -> (hidden, layers, intermediate, heads, kv heads, vocab)
SIZES = {
    "tiny": (64, 2, 128, 4, 2, 256),
    "small": (256, 4, 688, 8, 4, 2048),
    "medium": (1024, 8, 2816, 16, 4, 32000),
    # `flashdora parity` on CUDA: ~135M base parameters, the byte-level vocabulary (+84M adapter ones at r = 384)
    "base": (1024, 12, 2816, 16, 4, 256),
    # `flashdora parity --steps 2000` on CUDA: ~180M base parameters in 4 wide layers (+56M adapter ones at r = 384);
    # a third of base's launches per step, so a 2000-step run fits a short GPU session
    "wide": (2048, 4, 5632, 16, 4, 256),
}


WARMUP_CUDA = 3  # untimed first steps on CUDA (compiles); one on the CPU


def build_peft_model(size: str, rank: int, dropout: float, device, seed: int = 0, dtype=torch.float32, prepare=None):
    """A random Llama of ``SIZES[size]`` with PEFT DoRA on all linear projections (lora_B non-zero).

    ``prepare(base)``, when given, runs on the base model before the adapters are attached (e.g. pretraining).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, inter, heads, kv, vocab = SIZES[size]
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    if prepare is not None:
        prepare(model)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=dropout,
        use_dora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # random lora_B, so DoRA's delta is non-trivial from step 0
    )
    return get_peft_model(model, lora)


def _train(model, batches, steps, device, autocast, progress, task, warmup=1):
    """AdamW steps on the adapter parameters; returns (losses, median ms per step after the first ``warmup``, peak MiB
    or None, final logits)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    losses, times = [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    for step in range(steps):
        torch.manual_seed(1000 + step)  # the same dropout masks in both runs
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext():
            loss = model(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
        progress.advance(task)
    peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**20 if cuda else None
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext():
        logits = model(input_ids=batches[0]).logits.float()
    steady = sorted(times[warmup:] or times)  # the first steps pay one-time costs (allocator, kernel compilation)
    return losses, steady[len(steady) // 2], peak, logits


def flashdora_path(device: torch.device, counts: dict[str, int]) -> str | None:
    """What flashdora's timings measured when it was not its Triton kernels on CUDA: ``eager`` (plain PyTorch) or
    ``Triton interpreter``; None when it was."""
    if device.type == "cuda" and counts.get("triton"):
        return None
    return "Triton interpreter" if counts.get("triton") else "eager"


def speed_note(device: torch.device, path: str) -> str:
    """Why the demo's timings are not flashdora's GPU speed (``path`` from ``flashdora_path``); on the CPU, also why
    it prints no speed-up."""
    ran = "its eager path (plain PyTorch)" if path == "eager" else "its Triton kernels under the Triton interpreter"
    if device.type != "cuda":
        return (
            f"note: on {device.type} flashdora ran {ran}, not its Triton kernels on a GPU. CPU timings are not "
            "flashdora's claim and vary from run to run, so no speed-up is printed; the table's times are not "
            "flashdora's GPU speed (run the demo on CUDA for that; GPU measurements: docs/benchmarks.md)"
        )
    return (
        f"note: on {device.type} flashdora ran {ran}, not its Triton kernels on a GPU: these timings compare PEFT "
        f"DoRA with that path and are not flashdora's GPU speed (FLASHDORA_BACKEND=eager, or no Triton)"
    )


def speed_up(device: torch.device, path: str | None, peft_ms: float, fd_ms: float) -> str:
    """The summary line's first part: PEFT's time over flashdora's on CUDA; on the CPU none (``speed_note``)."""
    if device.type != "cuda":
        return "speed-up: not measured on the CPU (see the note below)"
    return ("speed-up" if path is None else f"speed-up ({path}, {device.type})") + f" {peft_ms / fd_ms:.2f}x"


def run(args: argparse.Namespace) -> int:
    """The demo; ``args`` as ``flashdora.tools.cli`` parses and checks them."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    size = args.size or ("medium" if cuda else "small")
    seq = args.seq or (512 if cuda else 128)
    console = Console()
    console.print(
        f"flashdora demo: Llama-style '{size}' model, DoRA r={args.rank}, dropout {args.dropout}, "
        f"{args.steps} steps of {args.batch}x{seq} tokens on {device}"
        + (" (bf16 autocast, fp32 adapters)" if cuda else " (fp32)")
    )
    peft_model = build_peft_model(size, args.rank, args.dropout, device, args.seed)
    flash_model = flashdora.enable(copy.deepcopy(peft_model))
    vocab = SIZES[size][5]
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, vocab, (args.batch, seq), generator=gen).to(device) for _ in range(args.steps)]

    # On CUDA the first steps compile Triton's kernels and load the C++ compose: untimed, as in every benchmark.
    warmup = min(WARMUP_CUDA if cuda else 1, args.steps - 1)
    if cuda:
        from flashdora import native

        native.load()  # built (or loaded) before flashdora's steps, not during them
    results = {}
    flashdora.reset_stats()
    with Progress(console=console, transient=True) as progress:
        for name, model in (("PEFT DoRA", peft_model), ("flashdora", flash_model)):
            task = progress.add_task(name, total=args.steps)
            results[name] = _train(model, batches, args.steps, device, cuda, progress, task, warmup)
            del model
            if cuda:
                torch.cuda.empty_cache()
    counts = flashdora.stats()
    if counts.get("eager", 0) + counts.get("triton", 0) == 0:
        raise SystemExit(f"flashdora demo: flashdora never ran (stats: {counts})")

    peft_losses, peft_ms, peft_peak, peft_logits = results["PEFT DoRA"]
    fd_losses, fd_ms, fd_peak, fd_logits = results["flashdora"]
    table = Table(title="PEFT DoRA vs flashdora (same weights, batches and dropout masks)")
    for col in ("", f"ms / step (median after {warmup} warm-up)", "peak MiB", "final loss"):
        table.add_column(col, justify="right")
    path = flashdora_path(device, counts)
    for name, (losses, ms, peak, _) in results.items():
        label = f"flashdora ({path})" if name == "flashdora" and path else name
        table.add_row(label, f"{ms:.1f}", "-" if peak is None else f"{peak:.0f}", f"{losses[-1]:.5f}")
    console.print(table)
    d_loss = max(abs(a - b) for a, b in zip(peft_losses, fd_losses))
    d_logits = (fd_logits - peft_logits).abs().max().item()
    console.print(
        speed_up(device, path, peft_ms, fd_ms) + f" | max |delta loss| over {args.steps} steps: {d_loss:.2e} | "
        f"max |delta logits| after training: {d_logits:.2e} (logit scale {peft_logits.abs().max().item():.2f})"
    )
    if path is not None:
        console.print(speed_note(device, path), style="yellow")
    console.print(f"flashdora path counters: {dict(sorted(counts.items()))}")
    return 0
