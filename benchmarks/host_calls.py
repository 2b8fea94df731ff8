"""Host work per model step, PEFT LoRA against flashdora, counted on the CPU: Python calls, aten ops, Triton launches.

The device machines' host decides flashdora's small-layer and grad-step ratios (docs/benchmarks.md). This counts
what that host time is made of, without a GPU: a small llama3-shaped model on the CPU, gradient checkpointing
(non-reentrant, as ``flashdora bench model``), bf16 autocast with fp32 adapters, the norm cached (weights unchanged,
as within one optimizer step). flashdora runs its Triton path's host code (the ``auto`` backend's choice on CUDA
tensors) with the kernel launches counted and stubbed out: the counts are the GPU path's, minus what Triton's
compiled launcher does in C. Outputs are garbage there; only the counts mean anything. Python calls are counted by
cProfile (Python functions only), aten ops by a dispatch mode (views included). Counts are exact and machine-
independent: a change that removes host work shows here before any device run. The CPU wall times beside them
include the CPU's own math on tiny tensors and move by tens of microseconds a layer between runs.

Usage: PYTHONPATH=src python3 benchmarks/host_calls.py [--layers 2] [--top 25] [--phases inference grad]
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import flashdora  # noqa: E402
from flashdora import backend  # noqa: E402
from flashdora.bench.model import TARGETS  # noqa: E402
from flashdora.kernels import configs  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=2)
p.add_argument("--top", type=int, default=25)
p.add_argument("--phases", nargs="+", default=["inference", "grad"])
p.add_argument("--backend", default="auto", choices=["auto", "eager"], help="eager: the eager path's host work")
args = p.parse_args()

launches = Counter()


def _launch(kernel, grid, key, args, flags):  # the kernels' launches: counted, not run (a C call on the GPU)
    launches[getattr(kernel.fn, "__name__", "kernel")] += 1


def _use_triton(*tensors):  # the auto backend's Python on CUDA tensors: the switch read, then Triton
    return backend.requested_backend() != "eager" and backend.triton_available()


torch.set_num_threads(1)  # steadier timings: the ops here are tiny
configs.launch = _launch
backend.use_triton = _use_triton
print("command: PYTHONPATH=src python3 benchmarks/host_calls.py " + " ".join(sys.argv[1:]))


def build(use_dora: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=224, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, use_cache=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, use_dora=use_dora,
                      init_lora_weights=False)  # fmt: skip
    return get_peft_model(model, lora, autocast_adapter_dtype=True)


ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops a step dispatches (below autograd: what reaches the device, views included)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def step(model, phase):
    if phase == "inference":
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
        return
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for q in TRAINABLE[id(model)]:  # (gathered once: a parameters() walk would be counted too)
        q.grad = None


def calls(model, phase):
    """``(cProfile stats, aten op counts, kernel launch counts)`` of one step."""
    model.train(phase == "grad")
    for _ in range(3):  # warm: caches filled, norm cached (weights unchanged, as within one optimizer step)
        step(model, phase)
    prof = cProfile.Profile(builtins=False)
    prof.enable()
    step(model, phase)
    prof.disable()
    launches.clear()
    with OpCounter() as mode:
        step(model, phase)
    return pstats.Stats(prof), mode.ops, Counter(launches)


lora = build(False)
dora = flashdora.enable(build(True))
TRAINABLE = {id(m): [q for q in m.parameters() if q.requires_grad] for m in (lora, dora)}
n_layers = sum(1 for m in dora.modules() if type(m).__name__ == "FlashDoraLinear")
os.environ["FLASHDORA_BACKEND"] = args.backend


def step_us(models, phase, n=20, turns=15) -> list[float]:
    """Per model: the median over ``turns`` alternating turns of a step's mean wall time over ``n`` (us)."""
    times = [[] for _ in models]
    for _ in range(turns):
        for model, ts in zip(models, times):
            model.train(phase == "grad")
            t = time.perf_counter()
            for _ in range(n):
                step(model, phase)
            ts.append((time.perf_counter() - t) / n * 1e6)
    return [statistics.median(ts) for ts in times]


def per_function(st) -> dict:
    """``{function: calls}`` of a step's profile."""
    return {f"{os.path.basename(f)}:{line}({name})": cc[1] for (f, line, name), cc in st.stats.items()}


for phase in args.phases:
    st_lora, ops_lora, _ = calls(lora, phase)
    flashdora.reset_stats()
    st, ops, kernels = calls(dora, phase)
    n_ops_lora, n_ops = sum(ops_lora.values()), sum(ops.values())
    n_kernels = sum(kernels.values())
    print(f"\n== {phase}, {n_layers} DoRA layers, per step: Python calls LoRA {st_lora.total_calls}, flashdora "
          f"{st.total_calls} ({(st.total_calls - st_lora.total_calls) / n_layers:+.1f} per layer); aten ops LoRA "
          f"{n_ops_lora}, flashdora {n_ops} + {n_kernels} Triton launches "
          f"({(n_ops + n_kernels - n_ops_lora) / n_layers:+.1f} per layer); paths {flashdora.stats()}")  # fmt: skip
    us_lora, us = step_us([lora, dora], phase)
    print(f"   CPU wall per step (us, kernels stubbed): LoRA {us_lora:.0f}, flashdora {us:.0f} "
          f"({(us - us_lora) / n_layers:+.1f} per layer)")  # fmt: skip
    print(f"   launches: {dict(kernels)}")
    delta = sorted(((ops[k] - ops_lora[k], k) for k in ops.keys() | ops_lora.keys()), reverse=True)
    print("   aten ops, flashdora - LoRA: " + ", ".join(f"{k} {d:+d}" for d, k in delta if d))
    a, b = per_function(st_lora), per_function(st)
    delta = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in a.keys() | b.keys()), reverse=True)
    print("   Python calls, flashdora - LoRA: function")
    for d, k in [x for x in delta if x[0] != 0][: args.top]:
        print(f"   {d:+6d}  {k}")
