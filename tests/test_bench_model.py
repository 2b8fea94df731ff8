"""``flashdora bench model`` on tiny CPU configs: result files, phases, rounds, quantized bases, dropout modes (no
timing asserts)."""

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
import transformers

import flashdora
import flashdora.native
from flashdora.tools.bench import model, model_phases, model_render
from flashdora.tools.cli import main
from tests.bench_helpers import check_header, md_row, run_bench


def test_model_files_and_schema(tmp_path):
    result, files = run_bench(tmp_path, "model", "--preset", "tiny", "--seq", "16", "--reps", "2", "--warmup", "1")
    check_header(result, "model", tmp_path)
    records = result["records"]
    default = [m for m in model.MODES if m not in ("flashdora_python", "flashdora_split", "flashdora_adapter")]
    assert {(r["mode"], r["phase"]) for r in records} == {(m, p) for m in default for p in ("inference", "grad")}
    for r in records:
        assert {"preset", "mode", "phase", "rank", "tokens", "ms", "peak_extra_gib"} <= set(r)
        assert (r["preset"], r["rank"], r["tokens"]) == ("tiny", 16, 16)  # the preset's rank: hidden size 64 / 4
        assert "error" not in r, r
        assert r["ms"] > 0 and r["peak_extra_gib"] is None
        assert r["warmup_s"] > 0  # the one warm-up step's wall time
        assert 0 < r["first_ms"] <= r["warmup_s"] * 1e3  # the first step is the warm-up's
    assert all(r["paths"] for r in records if r["mode"] == "flashdora")
    assert result["config"]["num_hidden_layers"] == 2
    assert "| tiny | grad | flashdora | 16 | 16 |" in files[".md"].read_text()


def test_model_rounds_pool_every_rounds_steps(tmp_path, monkeypatch):
    order = []
    measure = model.measure_mode

    def logged(target, mode, *args):
        order.append(mode)
        return measure(target, mode, *args)

    monkeypatch.setattr(model, "measure_mode", logged)
    argv = ["model", "--preset", "tiny", "--seq", "8", "--modes", "peft_lora", "flashdora", "--phases", "inference"]
    result, files = run_bench(tmp_path, *argv, "--reps", "3", "--warmup", "0", "--rounds", "3")
    assert order == ["peft_lora", "flashdora", "flashdora", "peft_lora", "peft_lora", "flashdora"]  # alternating
    assert result["protocol"]["rounds"] == 3 and result["protocol"]["order"].startswith("alternating")
    assert [r["mode"] for r in result["records"]] == ["peft_lora", "flashdora"]
    for r in result["records"]:
        assert len(r["times_ms"]) == 9 and len(r["round_ms"]) == 3, r
        assert min(r["round_ms"]) <= r["ms"] <= max(r["round_ms"])
        assert r["warmup_s"] == r["round_warmup_s"][0] and len(r["round_warmup_s"]) == 3
        assert r["first_ms"] == r["round_first_ms"][0] and len(r["round_first_ms"]) == 3
    text = files[".md"].read_text()
    assert "each round's median ms" in text and "vs peft_lora by round" in text
    lora, flash = ([r for r in result["records"] if r["mode"] == m][0]["round_ms"] for m in ("peft_lora", "flashdora"))
    assert " / ".join(f"{a / b:.2f}" for a, b in zip(flash, lora)) in text


def test_model_rounds_refuse_compile():
    with pytest.raises(SystemExit, match="--rounds > 1 with --compile"):
        main(["bench", "model", "--preset", "tiny", "--rounds", "2", "--compile", "--device", "cpu"])


def test_model_train_steps_the_optimizer(tmp_path, monkeypatch):
    changed, grads_left = {}, {}
    measure = model.measure_mode

    def checked(target, mode, *args):
        before = {n: p.detach().clone() for n, p in target.named_parameters() if p.requires_grad}
        rows = measure(target, mode, *args)
        after = dict(target.named_parameters())
        changed[mode] = (len(before), sum(not torch.equal(after[n], w) for n, w in before.items()))
        grads_left[mode] = sum(p.grad is not None for p in target.parameters())
        return rows

    monkeypatch.setattr(model, "measure_mode", checked)
    argv = ["model", "--preset", "tiny", "--rank", "4", "--seq", "8", "--phases", "train", "--reps", "2"]
    result, files = run_bench(tmp_path, *argv, "--warmup", "1", "--modes", "base", "peft_lora", "flashdora")
    records = {r["mode"]: r for r in result["records"]}
    assert list(records) == ["base", "peft_lora", "flashdora"] and {r["phase"] for r in records.values()} == {"train"}
    for r in records.values():
        assert "error" not in r, r
        assert r["ms"] > 0 and r["first_ms"] > 0 and len(r["times_ms"]) == 2
    assert changed["base"] == (0, 0) and records["base"]["optimizer_params"] == 0  # nothing to step
    for mode in ("peft_lora", "flashdora"):  # every trainable tensor (A, B, and DoRA's magnitude) was stepped
        n_trainable, n_changed = changed[mode]
        assert n_trainable == 2 * 7 * (3 if mode == "flashdora" else 2) and n_changed == n_trainable, mode
        assert records[mode]["optimizer_params"] > 0
    assert grads_left == {"base": 0, "peft_lora": 0, "flashdora": 0}  # zero_grad(set_to_none=True)
    assert "train: torch.optim.AdamW" in result["protocol"]["optimizer"]
    row = md_row(files[".md"].read_text(), "train", "flashdora")
    assert row["vs peft_lora"] == f"{records['flashdora']['ms'] / records['peft_lora']['ms']:.2f}"
    assert row["first ms"] == f"{records['flashdora']['first_ms']:.2f}"


def test_model_decode_generates_new_tokens_with_the_cache(tmp_path, monkeypatch):
    inputs = {}
    measure = model.measure_mode

    def watched(target, mode, *args):
        emb = target.get_input_embeddings()
        hook = emb.register_forward_hook(lambda mod, inp, out: inputs.setdefault(mode, []).append(inp[0].shape))
        try:
            return measure(target, mode, *args)
        finally:
            hook.remove()

    monkeypatch.setattr(model, "measure_mode", watched)
    argv = ["model", "--preset", "tiny", "--rank", "4", "--seq", "8", "--phases", "decode", "--reps", "2"]
    argv += ["--warmup", "0", "--prompt", "5", "--new-tokens", "3", "--modes", "peft_lora", "peft_dora", "flashdora"]
    result, files = run_bench(tmp_path, *argv)
    one_call = [(1, 5), (1, 1), (1, 1)]  # the prompt, then one token per forward: 3 new tokens, the KV cache on
    assert inputs == {mode: one_call * 2 for mode in ("peft_lora", "peft_dora", "flashdora")}
    for r in result["records"]:
        assert "error" not in r, r
        sizes = (r["phase"], r["batch"], r["seq"], r["prompt"], r["tokens"], r["new_tokens"])
        assert sizes == ("decode", 1, 5, 5, 3, 3)
        assert r["ms"] > 0 and r["first_ms"] > 0 and r["ms"] == pytest.approx(statistics.median(r["times_ms"]))
        assert r["tokens_per_s"] == pytest.approx(1e3 / r["ms"])  # ms is per generated token
    assert "3 new tokens" in result["protocol"]["decode"]
    lora_ms = result["records"][0]["ms"]
    row = md_row(files[".md"].read_text(), "decode", "flashdora")
    assert row["tokens"] == "3" and row["vs peft_lora"] == f"{result['records'][2]['ms'] / lora_ms:.2f}"


def test_model_decode_refuses_compile():
    with pytest.raises(SystemExit, match="decode without it"):
        main(["bench", "model", "--preset", "tiny", "--phases", "decode", "--compile", "--device", "cpu"])


def test_model_config_file_layers_and_bias(tmp_path):
    config = transformers.Qwen2Config(
        hidden_size=32,
        num_hidden_layers=3,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )  # Qwen2: q/k/v with bias
    path = tmp_path / "cfg" / "small-qwen2.json"
    path.parent.mkdir()
    path.write_text(config.to_json_string())
    out = tmp_path / "out"
    argv = ["model", "--config", str(path), "--layers", "1", "--rank", "8", "--seq", "8", "--dtype", "bf16"]
    result, _ = run_bench(out, *argv, "--modes", "peft_dora", "flashdora", "--reps", "1", "--warmup", "0")
    assert result["config"]["model_type"] == "qwen2" and result["config"]["num_hidden_layers"] == 1
    assert {r["preset"] for r in result["records"]} == {"small-qwen2-1l"}
    assert [(r["mode"], r["phase"]) for r in result["records"]] == [
        ("peft_dora", "inference"),
        ("peft_dora", "grad"),
        ("flashdora", "inference"),
        ("flashdora", "grad"),
    ]
    assert all("error" not in r for r in result["records"])


def test_model_quant_nf4_runs_qlora_qdora_and_flashdora(tmp_path, monkeypatch):
    """``--quant nf4``: the base's projections become bitsandbytes 4-bit layers; flashdora runs them (no fallback)."""
    bnb = pytest.importorskip("bitsandbytes")
    seen = []
    measure = model.measure_mode

    def checked(target, mode, *args):
        quantized = [m for m in target.modules() if isinstance(m, bnb.nn.Linear4bit)]
        for m in quantized:
            m.support_avx512bf16_for_cpu = False  # (see tests/test_qdora.py)
        seen.append((mode, len(quantized)))
        return measure(target, mode, *args)

    monkeypatch.setattr(model, "measure_mode", checked)
    flashdora.reset_stats()
    modes = ("--modes", "peft_lora", "peft_dora", "flashdora")
    result, _ = run_bench(tmp_path, "model", "--preset", "tiny", "--quant", "nf4", "--phases", "inference", *modes,
                          "--reps", "1", "--warmup", "1")  # fmt: skip
    assert [mode for mode, _ in seen] == ["peft_lora", "peft_dora", "flashdora"]
    assert all(n == 14 for _, n in seen)  # 2 layers x 7 projections
    assert all(r["ms"] for r in result["records"])
    assert not any(k.startswith("peft_fallback") for k in flashdora.stats())


def test_model_quant_needs_bitsandbytes(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    with pytest.raises(SystemExit, match="--quant nf4 needs bitsandbytes"):
        main(["bench", "model", "--preset", "tiny", "--quant", "nf4", "--device", "cpu"])


def test_model_dropout_runs_both_modes(tmp_path, monkeypatch):
    """``--dropout`` reaches every adapter, and ``flashdora_adapter`` runs ``enable(dropout="adapter")`` while
    ``flashdora`` runs the exact function (the layers' mode as each row ran)."""
    seen = {}
    measure = model.measure_mode

    def checked(target, mode, *args):
        from flashdora.report import _rows

        seen[mode] = {r[-1] for r in _rows(target)}
        return measure(target, mode, *args)

    monkeypatch.setattr(model, "measure_mode", checked)
    argv = ["model", "--preset", "tiny", "--rank", "4", "--seq", "8", "--phases", "grad", "--reps", "1"]
    modes = ["peft_lora", "peft_dora", "flashdora", "flashdora_adapter"]
    result, files = run_bench(tmp_path, *argv, "--warmup", "0", "--dropout", "0.1", "--modes", *modes)
    assert [r["mode"] for r in result["records"]] == modes and all(r["ms"] > 0 for r in result["records"])
    assert result["protocol"]["lora_dropout"] == 0.1
    assert seen == {"peft_lora": set(), "peft_dora": {"p=0.1 exact"}, "flashdora": {"p=0.1 exact"},
                    "flashdora_adapter": {"p=0.1 adapter"}}  # fmt: skip
    assert "| flashdora_adapter |" in files[".md"].read_text()


def test_native_off_restores_the_setting(monkeypatch):
    """``flashdora_python``'s row runs with ``configure(native=False)`` and leaves the caller's setting as it was."""
    for before in (True, False):
        flashdora.configure(native=before)
        with model_phases.native_off(True):
            assert not flashdora.config.native and not flashdora.native.enabled()
        assert flashdora.config.native is before
        with model_phases.native_off(False):
            assert flashdora.config.native is before


def test_split_mode_turns_the_layer_call_off_and_restores_it():
    """``flashdora_split``'s row runs with the C++ layer call off (``peft.variant.FUSE``), restored after, also when
    its step raises; other modes leave it on."""
    from flashdora.peft import variant

    assert variant.FUSE
    with model_phases.mode_switch("flashdora_split"):
        assert not variant.FUSE
    with pytest.raises(RuntimeError), model_phases.mode_switch("flashdora_split"):
        raise RuntimeError("a failing step")
    with model_phases.mode_switch("flashdora"):
        assert variant.FUSE and flashdora.config.native
    assert variant.FUSE


@pytest.mark.parametrize("interleave", [False, True])
def test_model_host_times_layer_calls_by_phase(tmp_path, interleave):
    """``--host``: one more step per mode with timers around the LoRA layers' forwards (forward and recomputation),
    the compose node's backward, the norm misses and the optimizer step; the classes' forwards come back after."""
    from peft.tuners.lora.layer import Linear as PeftLinear

    from flashdora.peft.layers import FlashDoraLinear

    forwards = (PeftLinear.__dict__["forward"], FlashDoraLinear.__dict__["forward"])
    argv = ["model", "--preset", "tiny", "--seq", "8", "--phases", "train", "inference", "--modes", "peft_lora"]
    argv += ["flashdora", "--reps", "1", "--warmup", "1", "--host", *(["--interleave"] if interleave else [])]
    result, files = run_bench(tmp_path, *argv)
    assert (PeftLinear.__dict__["forward"], FlashDoraLinear.__dict__["forward"]) == forwards
    assert "forward" not in FlashDoraLinear.__dict__ or FlashDoraLinear.__dict__["forward"] is forwards[1]
    rows = {(r["mode"], r["phase"]): r for r in result["records"]}
    layers = 2 * 7
    for mode in ("peft_lora", "flashdora"):
        train, infer = rows[(mode, "train")]["host"], rows[(mode, "inference")]["host"]
        assert train["forward"]["calls"] == layers and train["forward"]["us"] > 0 and train["forward"]["py_calls"] > 5
        assert train["recompute"]["py_calls"] > 5 and train["optimizer"]["py_calls"] > 0
        assert 0 < train["recompute"]["calls"] <= layers  # (non-reentrant checkpointing may stop a recomputation)
        assert train["optimizer"]["calls"] == 1 and infer["optimizer"]["calls"] == 0
        assert infer["forward"]["calls"] == layers and infer["recompute"]["calls"] == 0
        assert rows[(mode, "train")]["kernel_ms"] is None and "host_gap_ms" not in rows[(mode, "train")]  # (CPU)
    fd = rows[("flashdora", "train")]["host"]
    assert fd["backward"]["calls"] == layers and fd["norm_miss"]["calls"] == layers  # weights change every step
    assert 0 < fd["norm_miss"]["py_calls"] < fd["forward"]["py_calls"]  # (the miss runs inside the forward)
    assert sys.getprofile() is None  # the counting step leaves no profiler behind
    assert rows[("flashdora", "inference")]["host"]["norm_miss"]["calls"] == 0  # (kept since the train phase)
    assert rows[("peft_lora", "train")]["host"]["norm_miss"]["calls"] == 0
    md = files[".md"].read_text()
    assert "| tiny | train | flashdora | " in md.split("Host time by phase")[1] and "GPU ms" not in md
    assert f"({layers}; {fd['forward']['py_calls']:.0f} py)" in md


def test_model_host_refuses_compile():
    with pytest.raises(SystemExit):
        main(["bench", "model", "--preset", "tiny", "--host", "--compile", "--device", "cpu"])


def test_kernel_ms_of_a_row_is_the_median_of_three_profiled_steps(monkeypatch):
    """``host.view``: on CUDA a row's ``kernel_ms`` is the median of ``KERNEL_STEPS`` profiled steps (each one's in
    ``kernel_ms_steps``), per generated token in ``decode``; on the CPU, none."""
    from types import SimpleNamespace

    from flashdora.tools.bench import host

    assert host.KERNEL_STEPS == 3
    times = iter([3.0, 1.0, 2.5, 8.0, 4.0, 6.0])
    monkeypatch.setattr(host, "kernel_ms", lambda fn, device: next(times))
    monkeypatch.setattr(host.timing, "is_cuda", lambda device: True)
    args = SimpleNamespace(new_tokens=2, host=False)
    assert host.view(None, None, "train", args, "cuda") == {"kernel_ms": 2.5, "kernel_ms_steps": [3.0, 1.0, 2.5]}
    assert host.view(None, None, "decode", args, "cuda") == {"kernel_ms": 3.0, "kernel_ms_steps": [4.0, 2.0, 3.0]}
    monkeypatch.setattr(host.timing, "is_cuda", lambda device: False)
    monkeypatch.setattr(host, "kernel_ms", lambda fn, device: None)
    assert host.view(None, None, "train", args, "cpu") == {"kernel_ms": None}


def test_the_markdown_says_how_many_steps_a_gpu_time_is_the_median_of():
    """A result made before ``KERNEL_STEPS`` (no ``kernel_ms_steps``) is rendered again as one profiled step's."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for name, says in [
        ("2026-12-07_nvidia-h100-80gb-hbm3_model-s14-frozen1-r384-16l.json", "the median of 3 more steps"),
        ("2026-12-07_nvidia-h100-80gb-hbm3_model-host-r384-16l.json", "in one more step"),
    ]:
        result = json.loads((results / name).read_text())
        text = model_render.render_markdown(result)
        assert says in text and "more steps;" not in text.replace(says, ""), name


@pytest.mark.gpu
def test_gpu_kernel_ms_is_the_gpu_time_of_a_step():
    """``host.kernel_ms``: the profiled device time of one call, about a matmul's CUDA-event time."""
    from flashdora.tools.bench import host

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run `pytest -m gpu` on a GPU machine)")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    torch.cuda.synchronize()
    ms = host.kernel_ms(lambda: a @ a, "cuda")
    assert 0.5 * start.elapsed_time(end) < ms < 1.5 * start.elapsed_time(end)
