"""What flashdora's extra host time per model step is made of, by switching its parts off one at a time (GPU).

A few decoder layers of a preset (default llama3-8b, 4 layers, r = 384, autocast, gradient checkpointing), timed as
``profile_model.py`` does: ``host`` is the time Python takes to issue one step (queue empty at its start), ``wall``
its CUDA-event time. Variants, measured in alternation over ``--rounds`` so that host drift hits all alike:

- ``peft_lora``: PEFT LoRA, the floor.
- ``flashdora``: as shipped (the grad step bumps the weights' versions first, as an optimizer step would, so each
  layer recomputes its norm once per step).
- ``fd_keep_norm``: the same without the version bump (every norm lookup hits the cache).
- ``fd_no_group``: each layer recomputes its own norm (``FLASHDORA_NORM_GROUP=0``), as before the norm group.
- ``fd_no_launch``: the compose kernels' launches skipped at the last call (``configs.launch`` does all its host
  work, then does not call Triton's launcher), and the norm graphs not replayed. Outputs are garbage: the time
  only says what the launches themselves cost the host.

Usage: PYTHONPATH=src python3 benchmarks/host_attrib.py [--layers 4] [--rounds 3] [--phases grad inference]
[--variants flashdora fd_keep_norm ...]
"""

import argparse
import os
import statistics

import torch

import flashdora
from flashdora.bench import model as bm
from flashdora.bench import timing
from flashdora.kernels import configs
from flashdora.kernels import norm as kn

p = argparse.ArgumentParser()
bm.add_arguments(p)
p.set_defaults(layers=4)
p.set_defaults(rounds=3, reps=10)
VARIANTS = ("peft_lora", "flashdora", "fd_keep_norm", "fd_no_group", "fd_no_launch")
p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="peft_lora is always kept")
args = p.parse_args()
device = torch.device(args.device)
name, config = bm.build_config(args)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
base = bm.build_base(config, args, device)


def _noop(*a, **k):
    return None


class _NoGroup:
    """Within the block: each layer recomputes its own norm (``FLASHDORA_NORM_GROUP=0``), no norm group."""

    def __enter__(self):
        os.environ["FLASHDORA_NORM_GROUP"] = "0"

    def __exit__(self, *exc):
        os.environ.pop("FLASHDORA_NORM_GROUP", None)


class _NoLaunch:
    """Within the block: compose launches stop short of Triton's launcher, norm graphs are not replayed."""

    def __enter__(self):
        self.compiled = dict(configs._COMPILED)
        for key, hit in self.compiled.items():
            configs._COMPILED[key] = (hit[0], _noop, *hit[2:])
        self.call = kn.NormGraph.__call__
        kn.NormGraph.__call__ = lambda graph: (lambda out: (out[0], out[1:]))(graph.out.clone())

    def __exit__(self, *exc):
        configs._COMPILED.update(self.compiled)
        kn.NormGraph.__call__ = self.call


def grad_step(model, bump):
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]

    def step():
        if bump:
            torch.autograd.graph.increment_version(params)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for q in params:
            q.grad = None

    return step


def inference_step(model):
    def step():
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model(input_ids=ids)

    return step


lora = bm.wrap(base, args, False)
dora = bm.wrap(bm.build_base(config, args, device), args, True)  # its own base: host timing needs no shared weights
flashdora.enable(dora)
steps = {}
for phase in args.phases:
    if phase == "grad":
        steps[("peft_lora", phase)] = (grad_step(lora, True), None)
        steps[("flashdora", phase)] = (grad_step(dora, True), None)
        steps[("fd_keep_norm", phase)] = (grad_step(dora, False), None)
        steps[("fd_no_group", phase)] = (grad_step(dora, True), _NoGroup)
        steps[("fd_no_launch", phase)] = (grad_step(dora, True), _NoLaunch)
    else:
        steps[("peft_lora", phase)] = (inference_step(lora), None)
        steps[("flashdora", phase)] = (inference_step(dora), None)
        steps[("fd_no_launch", phase)] = (inference_step(dora), _NoLaunch)

steps = {k: v for k, v in steps.items() if k[0] == "peft_lora" or k[0] in args.variants}
results = {k: [] for k in steps}
for rnd in range(args.rounds):
    for key, (step, ctx) in steps.items():
        for _ in range(3):
            step()
        if ctx is None:
            results[key].append(timing.host_and_wall(step, args.reps, device))
        else:
            with ctx():
                results[key].append(timing.host_and_wall(step, args.reps, device))
    print(f"round {rnd + 1} done", flush=True)

n_layers = 7 * args.layers
where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
print(
    f"# {name}, {args.layers} layers ({n_layers} DoRA layers), r = {args.rank}, {args.batch}x{args.seq} tokens, "
    f"{where}; host / wall ms per step, median of {args.reps} steps per round"
)
for phase in args.phases:
    lora_host = statistics.median(h for h, _ in results[("peft_lora", phase)])
    for (mode, ph), rows in results.items():
        if ph != phase:
            continue
        hosts = [h for h, _ in rows]
        walls = [w for _, w in rows]
        host = statistics.median(hosts)
        print(
            f"{phase:9s} {mode:13s} host {host:7.2f} ms (rounds {' '.join(f'{h:.2f}' for h in hosts)}), "
            f"wall {statistics.median(walls):7.2f}; host above LoRA {(host - lora_host) / n_layers * 1e3:+7.1f} us "
            "per DoRA layer"
        )
