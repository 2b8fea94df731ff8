"""The route table (docs/design.md, "Routes") against what the code takes: every route a call takes is listed there
(this file's scenarios on the CPU, and every call of the whole test session: tests/conftest.py checks
``dispatch.SEEN`` at the end), and ``report()`` names the route that ran."""

import itertools
import re
from pathlib import Path

import pytest
import torch

import flashdora
from flashdora import dispatch
from flashdora.tools.demo import build_peft_model

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def table_routes(text: str | None = None) -> set[tuple[str, str, str]]:
    """``(compose, norm, base)`` for every row of design.md's route table (a cell may list several values)."""
    text = DESIGN.read_text() if text is None else text
    section = text.split("\n## Routes\n", 1)[1].split("\n## ", 1)[0]
    routes = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        values = [re.findall(r"`([^`]+)`", cell) for cell in cells[:3]]
        routes.update(itertools.product(*values))
    return routes


def unlisted(seen) -> set[tuple[str, str, str]]:
    return set(seen) - dispatch.routes()


def test_the_table_uses_only_defined_values():
    for compose, norm, base in dispatch.routes():
        assert compose in dispatch.COMPOSE and norm in dispatch.NORM and base in dispatch.BASE, (compose, norm, base)


def test_design_md_holds_the_table_dispatch_keeps():
    """docs/design.md's route table is ``dispatch.route_table()`` (regenerate it from there)."""
    assert dispatch.route_table() in DESIGN.read_text(), (
        "docs/design.md's route table differs from dispatch.ROUTES: paste the output of "
        "`python -c 'from flashdora import dispatch; print(dispatch.route_table())'`"
    )
    assert table_routes() == dispatch.routes()


def test_an_unlisted_route_fails_the_check():
    """The check can fail: a made-up route is reported, and a table without the eager row loses its routes."""
    assert unlisted({("native", "eager", "module")}) == {("native", "eager", "module")}
    text = DESIGN.read_text()
    without = "\n".join(line for line in text.splitlines() if not line.startswith("| `eager` | `eager`"))
    assert ("eager", "eager", "module") not in table_routes(without)


class _T:
    """A stand-in tensor: the attributes ``dispatch`` reads."""

    def __init__(self, dtype, cuda, meta=False):
        self.dtype, self.is_cuda, self.is_meta = dtype, cuda, meta
        self.device = "meta" if meta else "cuda" if cuda else "cpu"


def reachable(monkeypatch) -> set[tuple[str, str, str]]:
    """Every ``(compose, norm, base)`` that ``layer_route``, ``fused_route``, ``mixed_route``,
    ``linear_reference_route`` and ``linear_route`` give, over every combination of the predicates they read: meta
    tensors, a fallback reason, compiling, the base (``quant.base`` takes no shortcut on meta tensors or under
    compile), CUDA, Triton's availability, a float64 input, float64 adapters, ``double_backward``, grad mode, the bias
    (none, frozen, trained), dropout's exact form, the C++ extension, and the mixed path's own."""
    from flashdora import backend, config

    state = {}
    monkeypatch.setattr(dispatch, "reason", lambda *args: state["why"])
    monkeypatch.setattr(dispatch, "params_reason", lambda *args: None)
    monkeypatch.setattr(dispatch, "hooked_adapter", lambda *args: None)
    monkeypatch.setattr(dispatch, "is_bnb", lambda base: state["base"] != "module")
    monkeypatch.setattr(backend, "functorch_active", lambda: False)
    monkeypatch.setattr(config, "peft_tested", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: state["compiling"])
    monkeypatch.setattr(dispatch, "native_loaded", lambda x: state["native"] and x.is_cuda)
    monkeypatch.setattr(
        backend, "use_triton", lambda *ts: state["triton"] and all(t.dtype != torch.float64 for t in ts)
    )
    f32, f64 = torch.float32, torch.float64
    seen = set()
    grid = itertools.product(
        [False, True], [None, "why"], [False, True], ["module", "layer", "bnb"], [False, True], [False, True],
        [False, True], [False, True], [False, True], [False, True], [None, False, True], [False, True], [False, True],
    )  # fmt: skip
    for meta, why, compiling, base, cuda, triton, f64_in, f64_ad, double, grad, bias, lx, native in grid:
        if base == "bnb" and (meta or compiling):
            continue
        state.update(why=why, base=base, compiling=compiling, triton=triton, native=native)
        monkeypatch.setattr(config, "double_backward", double)
        x = result = _T(f64 if f64_in else f32, cuda, meta)
        weight = _T(f32, cuda, meta)
        weight.__dict__ = {**weight.__dict__}
        adapter = _T(f64 if f64_ad else f32, cuda)
        b = None if bias is None else torch.nn.Parameter(torch.zeros(1), requires_grad=bias)
        with torch.set_grad_enabled(grad):
            route = dispatch.layer_route(
                torch.nn.Module(), "a", None, weight, adapter, None, adapter, adapter, x, result, base, b, lx,
                native and cuda,
            )  # fmt: skip
            seen.add(route[:3])
            if base != "bnb":
                seen.add(dispatch.mixed_route(torch.nn.Module(), ["a"], x, base, why)[:3])
            if base == "module" and native and cuda and not lx:  # (peft.layers asks only where native_for said yes)
                module = torch.nn.Module()
                route = dispatch.fused_route(module, "a", None, weight, adapter, None, adapter, adapter, x, b)
                if route is not None:
                    seen.add(route[:3])
            if base == "module":
                route = dispatch.linear_reference_route(x, weight)
                if route is None and not meta:
                    route = dispatch.linear_route(x, weight, b, adapter, adapter, adapter, result, lx)
                if route is not None:
                    seen.add(route[:3])
    return seen


def test_the_reachable_routes_are_the_table_both_ways(monkeypatch):
    got = reachable(monkeypatch)
    assert got - dispatch.routes() == set(), "routes the code can take that the table does not list"
    assert dispatch.routes() - got == set(), "routes the table lists that no code path produces"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_cpu_routes_are_listed_and_reported(backend, monkeypatch):
    """A tiny model in training and inference, with and without dropout, under torch.func and on meta tensors: every
    route taken is in the table, and report() shows the last one per layer."""
    monkeypatch.setenv("FLASHDORA_BACKEND", backend)
    model = flashdora.enable(build_peft_model("tiny", 4, 0.1, "cpu"))
    ids = torch.randint(0, 256, (1, 8))
    model.train()
    model(input_ids=ids).logits.sum().backward()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    text = flashdora.report(model, print_table=False)
    assert f"{backend}/{backend}/module" in text and "not run" not in text
    layer = next(m for m in model.modules() if hasattr(m, "lora_variant"))
    assert dispatch.last_route(layer, "default") == (backend, backend, "module", None)
    assert not unlisted(dispatch.SEEN), unlisted(dispatch.SEEN)


def test_fallback_routes_are_listed(monkeypatch):
    """A hook on lora_A sends the layer to PEFT (``peft:hooks:Linear`` in report), and meta tensors take the meta
    route; both are in the table."""
    monkeypatch.setattr(flashdora.backend, "_warned", set())
    model = flashdora.enable(build_peft_model("tiny", 4, 0.0, "cpu"))
    layer = next(m for m in model.modules() if hasattr(m, "lora_variant"))
    handle = layer.lora_A["default"].register_forward_hook(lambda *args: None)
    with pytest.warns(UserWarning, match="hooks:Linear"):
        model(input_ids=torch.randint(0, 256, (1, 8)))
    handle.remove()
    assert dispatch.last_route(layer, "default").why == "hooks:Linear"
    with torch.device("meta"):
        meta = build_peft_model("tiny", 4, 0.0, "meta")
    flashdora.enable(meta)(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))
    assert ("peft", "-", "module") in dispatch.SEEN and ("meta", "-", "module") in dispatch.SEEN
    assert not unlisted(dispatch.SEEN), unlisted(dispatch.SEEN)


def test_configure_changes_the_route_at_the_next_call(monkeypatch):
    """``flashdora.configure`` takes effect from the next layer call: Triton (interpreter) then eager, same model."""
    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    model = flashdora.enable(build_peft_model("tiny", 4, 0.0, "cpu")).eval()
    layer = next(m for m in model.modules() if hasattr(m, "lora_variant"))
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        out = model(input_ids=ids).logits
        assert dispatch.last_route(layer, "default")[:2] == ("triton", "triton")
        flashdora.configure(backend="eager")
        ref = model(input_ids=ids).logits
        assert dispatch.last_route(layer, "default")[:2] == ("eager", "eager")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_untested_peft_runs_peft_forward_counted(monkeypatch):
    """Outside ``config.TESTED``'s PEFT range, ``enable`` keeps PEFT's layer classes (their private surface is
    untested) and each DoRA call runs PEFT's forward, counted as ``peft_fallback:peft-version``."""
    from flashdora import config

    monkeypatch.setattr(config, "_PEFT_TESTED", [False])
    model = build_peft_model("tiny", 4, 0.0, "cpu", seed=0)
    flashdora.enable(model)
    assert all(type(m).__name__ != "FlashDoraLinear" for m in model.modules())
    flashdora.reset_stats()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 8)))
    stats = flashdora.stats()
    assert stats.get("peft_fallback:peft-version", 0) > 0 and "eager" not in stats, stats


def test_the_session_check_sees_the_routes_of_xdist_workers(tmp_path):
    """scripts/test.sh runs the suite on pytest-xdist workers: a route taken in a worker still fails the session."""
    import subprocess
    import sys

    pytest.importorskip("xdist")
    test = tmp_path / "test_bogus_route.py"
    test.write_text(
        "from flashdora import dispatch\n\n"
        "def test_a():\n    dispatch.SEEN.add(('bogus-compose', 'bogus-norm', 'bogus-base'))\n\n"
        "def test_b():\n    pass\n"
    )
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-n", "2"]
    cmd.append(str(test))
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert "2 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 1 and "'bogus-compose'" in proc.stdout, proc.stdout[-2000:]
