"""``flashdora bench layer`` and what both benches share, on tiny CPU configs: the result files and their schema (no
timing asserts)."""

import argparse
import json
import statistics

import pytest
import torch

import flashdora
import flashdora.native
from flashdora.tools.bench import layer, model, record, step_kernels
from flashdora.tools.cli import main
from tests.bench_helpers import check_header, run_bench


def test_layer_files_and_schema(tmp_path):
    argv = ["layer", "--shapes", "32x48", "--ranks", "4", "--tokens", "8", "--reps", "2", "--warmup", "1"]
    result, files = run_bench(tmp_path, *argv, "--norm-shape", "32x64", "--norm-rank", "4")
    check_header(result, "layer", tmp_path)
    rows = result["rows"]
    assert len(rows) == 2 * 3 * 2  # dtypes x modes x phases
    assert {(r["dtype"], r["mode"], r["phase"]) for r in rows} == {
        (d, m, p) for d in layer.DTYPES for m in layer.MODES for p in layer.PHASES
    }
    for r in rows:
        assert (r["shape"], r["d_in"], r["d_out"], r["rank"], r["tokens"]) == ("32x48", 32, 48, 4, 8)
        assert "error" not in r, r
        assert r["ms"] > 0 and r["peak_extra_mib"] is None  # no memory numbers off CUDA
    assert all(r["paths"] for r in rows if r["mode"] == "flashdora")  # flashdora ran, PEFT did not
    assert not any(r["paths"] for r in rows if r["mode"] != "flashdora")
    assert len(result["ratios"]) == 2 * 2
    assert all(q["flashdora_over_lora"] > 0 and q["dora_over_flashdora"] > 0 for q in result["ratios"])
    assert result["device_peaks"]["copy_gbps"] > 0 and result["device_peaks"]["bf16_gemm_tflops"] > 0
    assert [(c["impl"], c["save_inner"]) for c in result["compose"] if c["impl"] == "eager"] == [
        ("eager", True),
        ("eager", False),
    ]
    assert all(c["ms"] > 0 and c["gbps"] > 0 for c in result["compose"] if c["impl"] == "eager")
    assert any(n["impl"] == "eager" and n["tflops"] > 0 for n in result["norm"])
    assert {n["impl"] for n in result["norm_compare"]} == {"peft_dense", "flashdora.factored_norm", "flashdora_eager"}
    assert all(n["ms"] > 0 for n in result["norm_compare"])
    md = files[".md"].read_text()
    assert "| 32x48 | 4 | 8 | autocast | forward |" in md and "## Kernels alone" in md


def test_layer_restricted_lists_no_kernels(tmp_path):
    argv = ["layer", "--shapes", "16x24", "--ranks", "2", "--tokens", "4", "--dtypes", "bf16", "--modes", "flashdora"]
    result, _ = run_bench(tmp_path, *argv, "--phases", "fwd_bwd", "--reps", "1", "--warmup", "0", "--no-kernels")
    assert [(r["dtype"], r["mode"], r["phase"]) for r in result["rows"]] == [("bf16", "flashdora", "fwd_bwd")]
    assert result["ratios"][0]["flashdora_over_lora"] is None  # no LoRA row to divide by
    assert "device_peaks" not in result


def test_layer_kernels_only_times_each_training_kernel_against_its_limit(tmp_path):
    argv = ["layer", "--kernels-only", "--shapes", "32x48", "--ranks", "4", "80", "--tokens", "8", "16"]
    result, files = run_bench(tmp_path, *argv, "--reps", "1", "--warmup", "0", "--norm-shape", "32x64")
    assert result["rows"] == [] and result["ratios"] == []  # no PEFT layer timed
    rows = result["step_kernels"]
    assert [(k["rank"], k["kernel"]) for k in rows] == [(r, k) for r in (4, 80) for k in step_kernels.KERNELS]
    peaks = result["device_peaks"]
    for k in rows:
        assert k["shape"] == "32x48" and k["tokens"] == 16 and k["ms"] > 0 and "error" not in k, k
        rate_limit = max(k["bytes"] / (peaks["copy_gbps"] * 1e9), k["flops"] / (peaks["bf16_gemm_tflops"] * 1e12))
        assert k["limit_ms"] == pytest.approx(rate_limit * 1e3)
        assert k["of_limit"] == pytest.approx(k["limit_ms"] / k["ms"])
    fwd = {k["rank"]: k for k in rows if k["kernel"] == "compose_fwd"}
    # r = 4: result, a, float32 lora_B, scales in; y, inner out (16 x 48 bf16 each); 2 T d_out r FLOPs
    assert fwd[4]["bytes"] == 16 * 48 * 2 * 3 + 16 * 4 * 2 + 48 * 4 * 4 + 2 * 48 * 4  # scale rows g, g - 1
    assert fwd[4]["flops"] == 2 * 16 * 48 * 4
    assert fwd[4]["cast_b_first"] is False
    bwd = next(k for k in rows if k["kernel"] == "compose_bwd" and k["rank"] == 4)
    assert bwd["bytes"] == 16 * 48 * 2 * 3 + 3 * 48 * 4 and bwd["flops"] == 0  # dy, inner in, g dy out; g, 1/n, dg
    miss = next(k for k in rows if k["kernel"] == "norm_miss" and k["rank"] == 80)
    assert miss["flops"] == 2 * 48 * 32 * 80 + 2 * 80 * 80 * (32 + 48)  # W a^T, a a^T, B G
    md = files[".md"].read_text()
    assert "against their limits (wall time per call: not a GPU" in md and "Median ms per call" not in md


def test_step_kernels_profiled_branch_frees_each_call_and_adds_up_kernels(monkeypatch):
    """``gpu_ms``'s CUDA branch with the profiler faked: at least one unprofiled call, each call's outputs freed
    before the next, kernels whose names match in their first 60 characters added up, per call, largest first."""
    import weakref

    live, made = [], []

    class Out:
        pass

    def fn():
        out = Out()
        made.append(1)
        live.append(weakref.ref(out))
        assert sum(ref() is not None for ref in live) <= 1  # the previous call's output is gone
        return out

    long = "void at::native::vectorized_elementwise_kernel<8, at::native::" + "x" * 10

    def fake_kernel_ms(run, device, by_name):
        run()
        by_name.update({long + "A>(int)": 4.0, long + "B>(int)": 2.0, "_compose_bwd_kernel": 8.0})
        return 14.0

    monkeypatch.setattr(step_kernels.timing, "is_cuda", lambda device: True)
    monkeypatch.setattr(step_kernels, "kernel_ms", fake_kernel_ms)
    ms, by_kernel = step_kernels.gpu_ms(fn, warmup=0, reps=4, device="cuda")
    assert len(made) == 1 + 4 and ms == pytest.approx(3.5)
    assert by_kernel == {"_compose_bwd_kernel": 2.0, long[:60]: 1.5}
    assert list(by_kernel) == ["_compose_bwd_kernel", long[:60]]


def test_step_kernels_a_failing_shape_leaves_error_rows_and_the_sweep_goes_on(monkeypatch, capsys):
    calls = step_kernels._calls

    def failing_first(d_in, n, r, tokens, device):
        if d_in == 32:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return calls(d_in, n, r, tokens, device)

    monkeypatch.setattr(step_kernels, "_calls", failing_first)
    peaks = {"copy_gbps": 1.0, "bf16_gemm_tflops": 1.0}
    reps = {"warmup": 0, "reps": 1, "device": torch.device("cpu")}
    rows = step_kernels.bench_step_kernels([(32, 48), (16, 24)], [4], 8, peaks, reps)
    assert [(k["shape"], k.get("error")) for k in rows] == [("32x48", "out of memory")] * 3 + [("16x24", None)] * 3
    assert all(k["ms"] is None for k in rows[:3]) and all(k["ms"] > 0 for k in rows[3:])
    assert capsys.readouterr().err.count("32x48 r=4") == 3


@pytest.mark.gpu
def test_step_kernels_on_cuda_are_the_kernels_a_training_call_runs():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run `pytest -m gpu` on a GPU machine)")
    reps = {"warmup": 1, "reps": 3, "device": torch.device("cuda")}
    peaks = {"copy_gbps": 2000.0, "bf16_gemm_tflops": 500.0}
    rows = step_kernels.bench_step_kernels([(512, 1024)], [16, 128], 256, peaks, reps)
    ran = {(k["rank"], k["kernel"]): " ".join(k["kernels"]) for k in rows}
    assert all(0 < k["ms"] < 5 and 0 < k["of_limit"] for k in rows), rows
    assert "_compose_fused_fwd_kernel" in ran[16, "compose_fwd"] and "_compose_bwd_kernel" in ran[128, "compose_bwd"]
    assert "_small_kernel" in ran[16, "norm_miss"]  # r <= 64: the one-launch miss
    assert "_epilogue_kernel" in ran[128, "norm_miss"] and "_scales_kernel" in ran[128, "norm_miss"]


def test_a_second_result_with_the_same_name_never_overwrites_the_first(tmp_path):
    result = {"timestamp": "2026-11-25T00:00:00", "device": {"type": "cpu"}, "bench": "layer", "args": {"tag": "t"}}
    written = [record.write({**result, "n": n}, tmp_path, lambda r: f"run {r['n']}\n", None) for n in range(3)]
    assert [p["json"].name for p in written] == [f"2026-11-25_cpu_layer-t{s}.json" for s in ("", "-2", "-3")]
    for n, paths in enumerate(written):
        assert json.loads(paths["json"].read_text())["n"] == n
        assert paths["md"].read_text() == f"run {n}\n" and paths["md"].stem == paths["json"].stem


def test_layer_rounds_alternate_and_pool(tmp_path, monkeypatch):
    order = []
    measure = layer._measure_mode

    def logged(fn, args, device):
        got = measure(fn, args, device)
        order.append(len(got["times_ms"]))
        return got

    monkeypatch.setattr(layer, "_measure_mode", logged)
    built = []
    monkeypatch.setattr(layer, "step_fn", lambda lay, *a: built.append(lay) or (lambda: None))
    argv = ["layer", "--shapes", "16x24", "--ranks", "2", "--tokens", "4", "--dtypes", "autocast", "--no-kernels"]
    argv += ["--modes", "peft_lora", "flashdora", "--phases", "forward", "--reps", "2", "--warmup", "0"]
    result, files = run_bench(tmp_path, *argv, "--rounds", "3")
    lora_first = built[0]
    assert [lay is lora_first for lay in built] == [True, False, False, True, True, False]  # alternating
    assert order == [2] * 6 and result["protocol"]["rounds"] == 3
    assert [r["mode"] for r in result["rows"]] == ["peft_lora", "flashdora"]
    for r in result["rows"]:
        assert len(r["times_ms"]) == 6 and len(r["round_ms"]) == 3, r
        assert min(r["round_ms"]) <= r["ms"] <= max(r["round_ms"])
    by_round = result["ratios"][0]["flashdora_over_lora_by_round"]
    assert len(by_round) == 3 and all(v > 0 for v in by_round)
    assert "pooled over 3 rounds" in files[".md"].read_text() and "by round" in files[".md"].read_text()


def test_render_regenerates_markdown_from_json(tmp_path):
    result, files = run_bench(tmp_path, "model", "--preset", "tiny", "--seq", "8", "--modes", "base", "--reps", "1")
    before = files[".md"].read_text()
    files[".md"].unlink()
    record.render(files[".json"], model.render_markdown, None)
    assert files[".md"].read_text() == before


def test_parse_shape_errors():
    assert layer.parse_shape("4096x14336") == (4096, 14336)
    with pytest.raises(argparse.ArgumentTypeError, match="D_INxD_OUT"):
        layer.parse_shape("4096")
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        layer.parse_shape("0x8")


def test_device_slug():
    cuda = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}
    assert record.device_slug(cuda) == "nvidia-h100-80gb-hbm3"
    assert record.device_slug({"type": "cpu", "name": "x86_64"}) == "cpu"


def test_table_escapes_pipes():
    assert record.table(["check"], [["mean |delta loss|"]]).splitlines()[-1] == "| mean \\|delta loss\\| |"


def test_layer_interleave_times_modes_call_by_call(tmp_path, monkeypatch):
    calls = []
    built = {}

    def step(lay, *a):
        name = next(m for m, (_, layer) in built.items() if layer is lay)
        return lambda: calls.append(name)

    real = layer.build_layers
    monkeypatch.setattr(layer, "build_layers", lambda *a: built.update(real(*a)) or built)
    monkeypatch.setattr(layer, "step_fn", step)
    argv = ["layer", "--shapes", "16x24", "--ranks", "2", "--tokens", "4", "--dtypes", "autocast", "--no-kernels"]
    argv += ["--phases", "forward", "--reps", "4", "--warmup", "1", "--interleave"]
    result, files = run_bench(tmp_path, *argv)
    modes = ["peft_lora", "peft_dora", "flashdora"]
    # Per mode: 1 warm-up + min(reps, 5) calls for memory; then 4 timed steps, each mode once, the order rotated.
    assert calls[:15] == [m for m in modes for _ in range(5)]
    assert calls[15:] == modes + modes[1:] + modes[:1] + modes[2:] + modes[:2] + modes
    assert result["protocol"]["interleave"] and result["protocol"]["order"].startswith("interleaved")
    for r in result["rows"]:
        assert len(r["times_ms"]) == 4 and r["ms"] == statistics.median(r["times_ms"]), r
    assert "call by call" in files[".md"].read_text()
    with pytest.raises(SystemExit, match="--interleave .* no --rounds"):
        main(["bench", *argv, "--rounds", "2", "--device", "cpu", "--out", str(tmp_path)])


def test_build_layers_share_values_across_modes():
    weight = torch.randn(24, 16, dtype=torch.bfloat16)
    layers = layer.build_layers(weight, 4, "autocast", ["peft_lora", "peft_dora", "flashdora"])
    (_, lora), (_, dora), (_, fd) = layers.values()
    for name in ("lora_A", "lora_B"):
        w = getattr(dora, name)["default"].weight
        assert torch.equal(getattr(lora, name)["default"].weight, w)
        assert torch.equal(getattr(fd, name)["default"].weight, w)
    m = dora.lora_magnitude_vector["default"].weight
    assert torch.equal(fd.lora_magnitude_vector["default"].weight, m)
    assert fd.lora_magnitude_vector["default"].weight is not m
    assert flashdora.peft.switch.layer_path(fd, "default").startswith("flashdora")
    assert flashdora.peft.switch.layer_path(dora, "default") == "peft"


def test_fsdp_render_gives_each_row_its_gap_to_dora_without_a_policy(tmp_path):
    """``bench fsdp --mp both``: the gap table (largest and last) and the PNG's second panel row; rows of another r
    or without a reference get no gap."""
    from flashdora.tools.bench import fsdp_render

    def row(r, mp, mode, losses):
        return {"preset": "tiny", "r": r, "mp": mp, "mode": mode, "ms": 1.0, "losses": losses}

    recs = [row(4, "off", "peft_dora", [3.0, 2.0, 1.0]), row(4, "bf16", "peft_dora", [3.0, 2.5, 1.1]),
            row(4, "bf16", "flashdora", [3.0, 1.98, 1.01]), row(8, "bf16", "flashdora", [3.0, 2.0, 1.0])]  # fmt: skip
    gaps = {(rec["mp"], rec["mode"], rec["r"]): gap for rec, gap in fsdp_render._gaps(recs)}
    assert list(gaps) == [("bf16", "peft_dora", 4), ("bf16", "flashdora", 4)]
    assert gaps[("bf16", "peft_dora", 4)] == pytest.approx([0.0, 0.5, 0.1])
    result = {**record.new_result("fsdp", "cpu", {}, {}), "records": recs}
    text = fsdp_render.render_markdown(result)
    assert "| 4 | bf16 | peft_dora | 0.5000 | 0.1000 |" in text
    assert "| 4 | bf16 | flashdora | 0.0200 | 0.0100 |" in text
    fsdp_render.render_png(result, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


def test_fsdp_render_pairs_interleaved_steps_with_loras():
    """``bench fsdp --interleave``: each mode's paired ratio is the median of its steps over PEFT LoRA's steps of the
    same rotation (not a ratio of medians); a launch-per-mode result gets no paired table."""
    from flashdora.tools.bench import fsdp_render

    def row(mode, times):
        return {"preset": "tiny", "r": 4, "mp": "bf16", "mode": mode, "ms": sorted(times)[1], "times_ms": times}

    recs = [row("peft_lora", [10.0, 20.0, 40.0]), row("flashdora", [11.0, 30.0, 40.0])]
    interleaved = {**record.new_result("fsdp", "cpu", {"order": "interleaved: ..."}, {}), "records": recs}
    assert fsdp_render._paired(interleaved) == [[4, "bf16", "flashdora", 1.1]]  # ratios 1.1, 1.5, 1.0
    assert "| 4 | bf16 | flashdora | 1.10 |" in fsdp_render.render_markdown(interleaved)
    separate = {**record.new_result("fsdp", "cpu", {"order": "a launch per mode"}, {}), "records": recs}
    assert fsdp_render._paired(separate) == [] and "paired vs peft_lora" not in fsdp_render.render_markdown(separate)


def test_bench_on_the_cpu_defaults_to_small_shapes_and_a_folder_outside_the_repository(monkeypatch):
    from flashdora.tools import cli, cli_defaults

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.build_parser().parse_args(["bench", "layer"])
    cli.check(args)
    assert args.device == "cpu" and args.out == "flashdora-bench"
    assert args.shapes == [(256, 512), (512, 256)] and args.ranks == [8] and args.tokens == [64]
    assert args.norm_shape == (512, 1024) and args.norm_rank == 16
    for command in (["bench", "model"], ["bench", "serve"], ["bench", "fsdp"]):
        args = cli.build_parser().parse_args(command)
        cli.check(args)
        assert args.preset == "tiny" and args.out == cli_defaults.OUT, command
    # given values are kept; on CUDA the defaults are the GPU-sized ones
    args = cli.build_parser().parse_args(["bench", "layer", "--shapes", "32x48", "--out", "benchmarks/results"])
    cli.check(args)
    assert args.shapes == [(32, 48)] and args.out == "benchmarks/results" and args.ranks == [8]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = cli.build_parser().parse_args(["bench", "layer"])
    cli.check(args)
    assert args.device == "cuda" and args.shapes == [cli.parse_shape(s) for s in cli.LAYER_SHAPES]
    assert args.tokens == list(cli.LAYER_TOKENS) and args.norm_shape == (8192, 28672) and args.out == "flashdora-bench"


def test_bench_layer_prints_a_line_per_case_and_writes_under_the_working_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "layer", "--shapes", "16x24", "--ranks", "2", "--tokens", "4", "--dtypes", "bf16"]
    assert main([*argv, "--reps", "1", "--warmup", "0", "--no-kernels", "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("bench layer [")]
    assert len(lines) == 2 * 3  # phases x modes, one line each as it is measured
    assert lines[0].startswith("bench layer [1/6] 16x24 r=2 bf16 4 tokens forward ") and lines[0].endswith(" ms")
    assert lines[-1].startswith("bench layer [6/6] 16x24 r=2 bf16 4 tokens fwd_bwd ")
    written = sorted(p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*.json"))
    assert written == ["flashdora-bench"]  # ./flashdora-bench/, not the repository's benchmarks/results
