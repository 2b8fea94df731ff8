"""Milliseconds per training step of PEFT DoRA and flashdora on the parity models (GPU): sizes the parity run.

Usage: PYTHONPATH=src python3 benchmarks/parity_step_time.py
"""

import copy
import time

import torch

import flashdora
from flashdora import demo, parity

corpus = parity.stdlib_corpus()
for size, batch, seq in (("wide", 8, 512), ("wide", 2, 512), ("base", 8, 512)):
    model = demo.build_peft_model(size, 384, 0.05, "cuda", seed=0)
    batches = [b.cuda() for b in parity.sample_batches(corpus, 40, batch, seq, 0)]
    flash = flashdora.enable(copy.deepcopy(model))
    peft = flashdora.disable(model)
    for name, m in (("peft", peft), ("flash", flash)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        for i, b in enumerate(batches):
            if i == 10:
                torch.cuda.synchronize()
                start = time.perf_counter()
            parity._step(m, opt, b, i, True)
        torch.cuda.synchronize()
        print(size, batch, seq, name, f"{(time.perf_counter() - start) / 30 * 1e3:.1f} ms/step", flush=True)
    del model, flash, peft
