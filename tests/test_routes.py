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
    return set(seen) - table_routes()


def test_the_table_uses_only_defined_values():
    for compose, norm, base in table_routes():
        assert compose in dispatch.COMPOSE and norm in dispatch.NORM and base in dispatch.BASE, (compose, norm, base)


def test_an_unlisted_route_fails_the_check():
    """The check can fail: a made-up route is reported, and a table without the eager row loses its routes."""
    assert unlisted({("native", "eager", "module")}) == {("native", "eager", "module")}
    text = DESIGN.read_text()
    without = "\n".join(line for line in text.splitlines() if not line.startswith("| `eager` | `eager`"))
    assert ("eager", "eager", "module") not in table_routes(without)


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
