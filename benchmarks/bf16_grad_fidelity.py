"""Per-tensor bf16 gradient error of flashdora and PEFT DoRA against a float32 reference (issue 54).

Set-up: a random-weight Llama (transformers ``LlamaConfig``), its base weights rounded to bf16 values; PEFT
``LoraConfig(use_dora=True, target_modules="all-linear", init_lora_weights=False)`` (random ``lora_B``, so
``lora_A`` gets a gradient). Three copies with the same values: the float32 reference (no autocast), PEFT DoRA
and flashdora, both with a bf16 base, float32 adapters (PEFT's default) and bf16 autocast. One forward and backward
of the causal-LM loss on ``--tokens`` random tokens; for every trainable tensor, ``||grad - ref|| / ||ref||``.

Two views: the whole model (each implementation's gradient after its own bf16 forward and backward: upstream
rounding included), and one layer in isolation (``--layer``; the reference run's input and output gradient of that
layer, rounded to bf16, fed to each implementation's copy of the layer and judged against float64 of the same
inputs: only the layer's own rounding). flashdora runs once per ``--routes`` entry (``eager``, ``triton``, ``native``:
the C++ node; ``--warmup`` passes run before the measured one).

    python benchmarks/bf16_grad_fidelity.py --out /tmp/fidelity.md                     # GPU: llama3-8b widths
    python benchmarks/bf16_grad_fidelity.py --preset small --device cpu --routes eager --out /tmp/f.md

Self-contained: needs torch, transformers, peft and flashdora; prints the table and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import subprocess
import sys
import time

import torch

ROUTES = {"eager": dict(backend="eager", native=False), "triton": dict(backend="triton", native=False),
          "native": dict(backend="auto", native=True)}  # flashdora.configure settings
PRESETS = {  # hidden, intermediate, heads, kv heads, vocab
    "8b": (4096, 14336, 32, 8, 32000),
    "mid": (1024, 3584, 8, 2, 8000),
    "small": (256, 896, 4, 2, 2000),
    "tiny": (64, 224, 4, 2, 500),
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0, help="lora_alpha (scaling = alpha / rank)")
    p.add_argument("--mag-noise", type=float, default=0.0,
                   help="scale each magnitude by (1 + noise * randn): g away from 1, as after training")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--routes", nargs="+", choices=ROUTES, default=None,
                   help="flashdora routes to measure (default: native triton eager on CUDA, eager elsewhere)")
    p.add_argument("--warmup", type=int, default=2, help="forward+backward passes before the measured one")
    p.add_argument("--layer", default="layers.0.mlp.up_proj", help="the layer checked in isolation ('' for none)")
    p.add_argument("--reference", choices=("float32", "float64"), default="float32")
    p.add_argument("--out", required=True, help="where to write the Markdown result")
    return p.parse_args(argv)  # fmt: skip


def build(args, seed: int):
    """``(reference, peft_bf16)``: one random PEFT DoRA model, as the reference and with a bf16 base."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, vocab = PRESETS[args.preset]
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=max(args.tokens, 128),
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    base = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for prm in base.parameters():  # bf16 values, so the reference differs from the bf16 runs by arithmetic only
            prm.copy_(prm.to(torch.bfloat16).float())
    lcfg = LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules="all-linear", use_dora=True,
        init_lora_weights=False,
    )  # fmt: skip
    ref = get_peft_model(base, lcfg)
    if args.mag_noise:
        with torch.no_grad():
            for name, prm in ref.named_parameters():
                if "lora_magnitude_vector" in name:
                    prm.mul_(1 + args.mag_noise * torch.randn_like(prm))
    peft_m = copy.deepcopy(ref)
    for prm in peft_m.parameters():
        if not prm.requires_grad:  # the frozen base in bf16; adapters stay float32 (PEFT's default)
            prm.data = prm.data.to(torch.bfloat16)
    ref = ref.to(args.device, torch.float64) if args.reference == "float64" else ref.to(args.device)
    return ref, peft_m.to(args.device)


def grads(model, ids, autocast: bool, device: str, warmup: int = 0, hook=None):
    """``({name: float64 gradient}, loss)`` after ``warmup`` unmeasured passes and one measured forward and
    backward on ``ids``; ``hook(model)`` runs before the measured pass."""
    model.train()
    for i in range(warmup + 1):
        if i == warmup and hook is not None:
            hook(model)
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    out = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out, float(loss.detach())


def capture(name: str):
    """A ``hook(model)`` that records the input and the output gradient of the module ``name`` in ``store``."""
    store = {}

    def hook(model):
        mod = model.get_submodule(f"base_model.model.model.{name}")

        def fwd(_, inputs, output):
            store["x"] = inputs[0].detach()
            output.register_hook(lambda g: store.__setitem__("dy", g.detach()))

        store["handle"] = mod.register_forward_hook(fwd)

    return hook, store


def isolated(args, name: str, ref, peft_m, flash: dict, store: dict) -> dict[str, dict[str, float]]:
    """``{implementation: {tensor: rel. error}}`` of the layer ``name`` alone, on the reference run's bf16-rounded
    ``x`` and ``dy``, against float64 of the same inputs."""
    import flashdora

    x, dy = store["x"].to(torch.bfloat16), store["dy"].to(torch.bfloat16)
    path = f"base_model.model.model.{name}"
    out = {}
    runs = [("ref", ref, None)] + [("peft", peft_m, None)] + [(f"flash:{k}", m, k) for k, m in flash.items()]
    got = {}
    for label, model, route in runs:
        mod = copy.deepcopy(model.get_submodule(path))
        if label == "ref":
            mod = mod.double()
        if route is not None:
            flashdora.configure(**ROUTES[route])
        for _ in range(args.warmup + 1 if route == "native" else 1):
            mod.zero_grad(set_to_none=True)
            with torch.autocast(torch.device(args.device).type, torch.bfloat16, enabled=label != "ref"):
                y = mod(x.double() if label == "ref" else x)
            y.backward(dy.to(y.dtype))
        got[label] = {short(n): p.grad.double().cpu() for n, p in mod.named_parameters() if p.grad is not None}
    for label, g in got.items():
        if label != "ref":
            out[label] = {n: rel(t, got["ref"][n]) for n, t in g.items()}
    return out


def short(name: str) -> str:
    """``layers.0.mlp.up_proj.lora_A`` from PEFT's long parameter name."""
    name = name.replace("base_model.model.model.", "").replace(".default.weight", "").replace(".default", "")
    return name.replace("lora_magnitude_vector", "magnitude").replace(".weight", "")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(max(x, 1e-300)) for x in xs) / len(xs))


def run(args) -> tuple[list[str], list[dict], dict, dict]:
    """``(labels, rows, losses, isolated)``: per-tensor errors (geometric mean over seeds) of every implementation."""
    import flashdora

    routes = args.routes or (["native", "triton", "eager"] if args.device.startswith("cuda") else ["eager"])
    labels = ["peft"] + [f"flash:{r}" for r in routes]
    rows: dict[str, dict] = {}
    losses, iso, stats = {}, {}, {}
    for seed in args.seeds:
        ref, peft_m = build(args, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(0, ref.config.vocab_size, (1, args.tokens), generator=gen).to(args.device)
        hook, store = capture(args.layer) if args.layer else (None, {})
        errs = {}
        ref_g, losses[f"ref/{seed}"] = grads(ref, ids, False, args.device, hook=hook)
        if args.layer:
            store["handle"].remove()
        flash = {}
        for label in labels:
            if label == "peft":
                model = peft_m
            else:
                route = label.split(":")[1]
                model = flashdora.enable(copy.deepcopy(peft_m))
                flashdora.configure(**ROUTES[route])
                flashdora.reset_stats()
                flash[route] = model
            g, losses[f"{label}/{seed}"] = grads(model, ids, True, args.device, args.warmup)
            if label != "peft":
                stats[label] = dict(flashdora.stats())
            errs[label] = {short(n): rel(g[n], r) for n, r in ref_g.items()}
        if args.layer:
            for label, e in isolated(args, args.layer, ref, peft_m, flash, store).items():
                for n, v in e.items():
                    iso.setdefault(label, {}).setdefault(n, []).append(v)
        for n in ref_g:
            row = rows.setdefault(short(n), {"tensor": short(n), **{k: [] for k in labels}})
            for label in labels:
                row[label].append(errs[label][short(n)])
        del ref, peft_m, flash
    out = [{"tensor": r["tensor"], **{k: gmean(r[k]) for k in labels}} for r in rows.values()]
    iso = {k: {n: gmean(v) for n, v in e.items()} for k, e in iso.items()}
    return labels, out, {"losses": losses, "stats": stats}, iso


def report(args, labels, rows: list[dict], info: dict, iso: dict, seconds: float) -> str:
    import peft
    import transformers

    import flashdora

    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "?"  # fmt: skip
    except OSError:
        commit = "?"
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    hidden, inter, heads, kv, vocab = PRESETS[args.preset]
    flash = [k for k in labels if k != "peft"]
    lines = [
        "# bf16 gradient fidelity: flashdora and PEFT DoRA against a float32 reference",
        "",
        f"- command: `{' '.join(sys.argv)}`",
        f"- device: {dev}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}, flashdora {flashdora.__version__}, commit {commit}; {seconds:.0f} s",
        f"- model: Llama, {args.layers} layers, hidden {hidden}, intermediate {inter}, heads {heads}/{kv}, vocab "
        f"{vocab}; {args.tokens} tokens; r {args.rank}, alpha {args.alpha:g} (s = {args.alpha / args.rank:g}); "
        f"mag noise {args.mag_noise:g}; seeds {args.seeds}; reference {args.reference}; warm-up {args.warmup}",
        *(f"- {k} routes taken (warm-up included): {info['stats'][k]}" for k in flash),
        f"- losses: {', '.join(f'{k} {v:.5f}' for k, v in info['losses'].items())}",
        "",
        "Relative error `||grad - ref|| / ||ref||` (geometric mean over seeds); ratio: flashdora / PEFT.",
        "",
    ]
    for k in flash:
        for kind in ("lora_A", "lora_B", "magnitude"):
            sel = sorted((r[k] / r["peft"], r["tensor"]) for r in rows if r["tensor"].endswith(kind))
            if sel:
                worst, median = sel[-1], sel[len(sel) // 2][0]
                lines.append(f"- {k} {kind}: worst ratio {worst[0]:.2f} ({worst[1]}), median {median:.2f}")
    if iso:
        lines += ["", f"Layer `{args.layer}` alone (the reference's x and dy in bf16; judged against float64):", ""]
        names = list(iso["peft"])
        lines += ["| implementation | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for k, e in iso.items():
            lines.append(f"| {k} | " + " | ".join(f"{e[n]:.3e}" for n in names) + " |")
    lines += ["", "Whole model:", ""]
    head = ["tensor", "PEFT"] + [f"{k} | ratio" for k in flash]
    lines += ["| " + " | ".join(head) + " |", "|---" * (1 + len(labels) + len(flash)) + "|"]
    for r in rows:
        cells = [r["tensor"], f"{r['peft']:.3e}"] + [f"{r[k]:.3e} | {r[k] / r['peft']:.2f}" for k in flash]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse(argv)
    t0 = time.perf_counter()
    labels, rows, info, iso = run(args)
    text = report(args, labels, rows, info, iso, time.perf_counter() - t0)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
