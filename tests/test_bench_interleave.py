"""``flashdora bench model --interleave``: a model per mode timed step by step, ``--dynamic``'s drawn token counts,
and its out-of-memory message (tiny CPU configs, no timing asserts)."""

import statistics

import pytest
import torch

from flashdora.tools.bench import model_phases
from flashdora.tools.cli import main
from tests.bench_helpers import md_row, run_bench


def test_model_interleave_times_each_mode_step_by_step(tmp_path, monkeypatch):
    """``--interleave``: a model per mode (copies of one base, the same adapter values), each timed step runs every
    mode once with the start rotated, train steps each mode's own weights, and the Markdown pairs steps."""
    from flashdora.tools.bench import model_interleave

    calls, models = [], {}
    make = model_phases.step_fn
    modes = ["peft_lora", "peft_dora", "flashdora"]

    def logged(target, ids, phase, args):  # called once per mode, in the listed order
        mode = modes[len(models)]
        models[mode] = target
        fn = make(target, ids, phase, args)

        def call():
            calls.append(mode)
            fn()

        return call

    monkeypatch.setattr(model_interleave, "step_fn", logged)
    argv = ["model", "--preset", "tiny", "--rank", "4", "--seq", "8", "--phases", "train", "--modes", *modes]
    result, files = run_bench(tmp_path, *argv, "--reps", "3", "--warmup", "1", "--interleave")
    assert result["protocol"]["order"].startswith("interleaved")
    first, warm, timed = calls[:3], calls[3:6], calls[6:]
    assert first == modes and warm == modes  # first steps, then one warm-up step
    assert timed == modes + modes[1:] + modes[:1] + modes[2:] + modes[:2]  # the start rotates step by step
    assert len({id(m) for m in models.values()}) == 3  # a model per mode
    bases = [dict(m.base_model.model.named_parameters()) for m in models.values()]
    assert all(torch.equal(b["lm_head.weight"], bases[0]["lm_head.weight"]) for b in bases)  # copies of one base
    assert all(b["lm_head.weight"].data_ptr() != bases[0]["lm_head.weight"].data_ptr() for b in bases[1:])
    records = {r["mode"]: r for r in result["records"]}
    for r in records.values():
        assert "error" not in r, r
        assert len(r["times_ms"]) == 3 and r["ms"] == statistics.median(r["times_ms"]) and r["first_ms"] > 0
        assert r["warmup_s"] > 0
    assert records["flashdora"]["paths"] and not records["peft_dora"]["paths"]
    row = md_row(files[".md"].read_text(), "train", "flashdora")
    lora = records["peft_lora"]["times_ms"]
    want = statistics.median(a / b for a, b in zip(records["flashdora"]["times_ms"], lora))
    assert row["paired vs peft_lora"] == f"{want:.2f}"
    # Each mode trained its own adapters, from the same values on the same tokens: DoRA's two agree, LoRA's differ.
    lora_a, dora_a, flash_a = ([p for n, p in models[m].named_parameters() if "lora_A" in n] for m in modes)
    assert len(dora_a) == len(flash_a) == 14 and all(a.data_ptr() != b.data_ptr() for a, b in zip(dora_a, flash_a))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(dora_a, flash_a))
    assert not all(torch.equal(a, b) for a, b in zip(lora_a, dora_a))
    with pytest.raises(SystemExit, match="--interleave .* no --rounds"):
        main(["bench", *argv, "--interleave", "--rounds", "2", "--device", "cpu", "--out", str(tmp_path)])


def test_model_dynamic_draws_a_token_count_per_step_for_every_mode(tmp_path, monkeypatch):
    """``--dynamic``: each timed step runs every mode at the fixed length, then at one drawn count (the same for every
    mode) after an untimed pass with the adapters off; the Markdown pairs both."""
    from flashdora.tools.bench import model_interleave

    seen, passes = [], []
    make, base = model_phases.step_fn, model_interleave.base_pass

    def logged(target, feed, phase, args):
        fn = make(target, feed, phase, args)

        def call():
            seen.append(feed.ids.shape[1])
            fn()

        return call

    def counted(model, feed, args, adapters):
        passes.append((feed.ids.shape[1], adapters, model.active_adapters))
        base(model, feed, args, adapters)
        assert all(p.grad is None for n, p in model.named_parameters() if "lora_" in n)  # (nothing kept)

    monkeypatch.setattr(model_interleave, "step_fn", logged)
    monkeypatch.setattr(model_interleave, "base_pass", counted)
    argv = ["model", "--preset", "tiny", "--rank", "4", "--seq", "16", "--phases", "train"]
    result, files = run_bench(tmp_path, *argv, "--modes", "peft_lora", "flashdora", "--reps", "3", "--warmup", "1",
                              "--interleave", "--dynamic", "5-12")  # fmt: skip
    records = {r["mode"]: r for r in result["records"]}
    seqs = records["flashdora"]["seqs"]
    assert records["peft_lora"]["seqs"] == seqs and len(seqs) == 3 and all(5 <= s <= 12 for s in seqs)
    assert [p[0] for p in passes] == seqs and all(p[1] for p in passes)
    timed = seen[4:]  # (after the first and the warm-up steps at 16)
    assert timed == [16, 16, seqs[0], seqs[0], 16, 16, seqs[1], seqs[1], 16, 16, seqs[2], seqs[2]]
    for r in records.values():
        assert "error" not in r, r
        assert len(r["times_ms"]) == len(r["fixed_times_ms"]) == 3 and r["tokens"] == round(statistics.mean(seqs))
    assert records["flashdora"]["paths"]
    lora, flash = records["peft_lora"], records["flashdora"]
    fixed = statistics.median(a / b for a, b in zip(flash["fixed_times_ms"], lora["fixed_times_ms"]))
    text = files[".md"].read_text()
    assert f"drew the tokens per sequence from 5..12 ({', '.join(map(str, seqs))};" in text
    assert f"paired vs peft_lora at that fixed length: train flashdora {fixed:.2f}" in text
    assert "dynamic" in result["protocol"]


def test_model_interleave_out_of_memory_names_the_way_out(tmp_path, monkeypatch):
    """A model per mode that does not fit ends the run with a message naming the modes and the options to change,
    not a traceback."""
    from flashdora.tools.bench import model_interleave

    prepare, built = model_interleave.prepare, []

    def second_does_not_fit(model, args):  # the first copy fits, the second does not
        if built:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        built.append(model)
        return prepare(model, args)

    monkeypatch.setattr(model_interleave, "prepare", second_does_not_fit)
    argv = ["bench", "model", "--preset", "tiny", "--seq", "8", "--modes", "peft_lora", "flashdora", "--interleave"]
    with pytest.raises(SystemExit, match=r"out of memory .*2 copies of tiny: peft_lora, flashdora.*fewer --modes"):
        main([*argv, "--device", "cpu", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # no result files for a run that measured nothing
