"""``flashdora dropout-study`` on a tiny CPU model: the result files, the variants it really ran, and the control
that adapter dropout at p = 0 is PEFT's DoRA."""

import json
import math

import pytest

from flashdora.tools import parity_dropout
from flashdora.tools.cli import UsageError, main
from tests.test_cli_help import _probe


def _argv(tmp_path, *extra):
    argv = ["dropout-study", "--size", "tiny", "--steps", "4", "--seeds", "2", "--pretrain", "4", "--rank", "4"]
    return [*argv, "--seq", "32", "--batch", "2", "--heldout-batches", "2", "--device", "cpu", "--out", str(tmp_path),
            *extra]  # fmt: skip


def _run(tmp_path, *extra) -> dict:
    assert main(_argv(tmp_path, *extra)) == 0
    (path,) = tmp_path.glob("*_cpu_parity-dropout*.json")
    assert path.with_suffix(".md").is_file() and path.with_suffix(".png").stat().st_size > 0
    return json.loads(path.read_text()) | {"_md": path.with_suffix(".md").read_text()}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("study"))


def test_writes_every_variant_and_seed(study):
    summary, runs = study["summary"], study["runs"]
    assert study["bench"] == "parity-dropout" and study["command"][:2] == ["flashdora", "dropout-study"]
    assert [r["seed"] for r in runs] == [0, 1] and study["settings"]["dropout"] == 0.1
    assert set(summary["heldout"]) == set(parity_dropout.VARIANTS) and summary["finite"]
    for v in parity_dropout.VARIANTS:
        assert len(summary["heldout"][v]["values"]) == 2 and summary["heldout"][v]["std"] is not None
        assert all(math.isfinite(x) for x in summary["heldout"][v]["values"])
        assert all(len(r["curves"][v]) == 4 for r in runs)
    adapter, dora = summary["heldout"]["flashdora_adapter"]["values"], summary["heldout"]["peft_dora"]["values"]
    want = [a - d for a, d in zip(adapter, dora)]
    assert summary["minus_peft_dora"]["flashdora_adapter"]["values"] == pytest.approx(want)
    for label in parity_dropout.LABELS.values():
        assert f"| {label} |" in study["_md"]


def test_each_variant_ran_its_own_path(study):
    """The adapter variant is flashdora in adapter mode at p = 0.1, PEFT DoRA is PEFT's, LoRA has no DoRA layer; and
    the three really differ (dropout is on)."""
    layers = study["runs"][0]["layers"]
    assert layers["flashdora_adapter"] == {"flashdora:eager, dropout adapter": 14}  # tiny: 2 layers x 7 projections
    assert layers["peft_dora"] == {"peft, dropout exact": 14} and layers["peft_lora"] == {}
    assert study["path_counts"].get("eager", 0) >= 2 * 4 * 14
    curves = study["runs"][0]["curves"]
    assert curves["flashdora_adapter"] != curves["peft_dora"] != curves["peft_lora"]


def test_adapter_mode_without_dropout_is_peft_dora(tmp_path):
    """At p = 0 the adapter mode and PEFT's exact function are one function: the same held-out loss (to rounding),
    while LoRA, another function once trained, is not."""
    res = _run(tmp_path, "--dropout", "0", "--seeds", "1")
    heldout = res["runs"][0]["heldout"]
    assert heldout["flashdora_adapter"] == pytest.approx(heldout["peft_dora"], rel=1e-4)
    assert res["runs"][0]["layers"]["flashdora_adapter"] == {"flashdora:eager, dropout adapter": 14}
    assert abs(heldout["peft_lora"] - heldout["peft_dora"]) > 1e-4 * heldout["peft_dora"]


def test_bad_options_exit_before_any_work(tmp_path):
    for extra in (["--heldout-batches", "0"], ["--dropout", "1"], ["--pretrain", "-1"]):
        with pytest.raises(UsageError):
            main(_argv(tmp_path, *extra))
    with pytest.raises(SystemExit, match="--lr expected > 0"):
        main(_argv(tmp_path, "--lr", "0"))
    assert not list(tmp_path.iterdir())


def test_help_imports_nothing_heavy():
    (got,) = _probe([["dropout-study"]], stub=True)
    assert got["code"] == 0 and got["heavy"] == []
