import pytest

import flashdora
from flashdora.tools.demo import build_peft_model


def test_report_lists_every_dora_layer_with_its_path(capsys):
    model = build_peft_model("tiny", 4, 0.0, "cpu")
    text = flashdora.report(model, print_table=False)
    assert text.count(" peft\n") + text.rstrip().count(" peft") >= 14
    assert "DoRA layers by path: peft: 14" in text
    flashdora.enable(model)
    flashdora.reset_stats()
    assert "DoRA layers by path: flashdora:not run: 14" in flashdora.report(model, print_table=False)
    import torch

    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 4)))
    text = flashdora.report(model, print_table=True)
    assert "DoRA layers by path: flashdora:eager: 14" in text  # one route column: what dispatch recorded
    assert "layers.1.mlp.down_proj" in text and "flashdora:eager/eager/module" in text
    printed = capsys.readouterr().out
    assert "flashdora report" in printed and "flashdora:eager/eager/module" in printed


def test_report_shows_the_counters():
    model = flashdora.enable(build_peft_model("tiny", 4, 0.0, "cpu"))
    flashdora.reset_stats()
    import torch

    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 4)))
    expected = "calls since reset_stats(): {'eager': 14, 'norm:base_sq': 14, 'norm:eager': 14}"
    assert expected in flashdora.report(model, print_table=False)


def test_report_of_a_model_without_dora():
    import torch

    assert "no DoRA layers found" in flashdora.report(torch.nn.Linear(2, 2), print_table=False)
    with pytest.raises(TypeError, match="report: model expected a torch.nn.Module"):
        flashdora.report(42)


def test_report_prints_whole_module_names(capsys):
    from peft import LoraConfig, get_peft_model
    from torch import nn

    model = nn.Module()
    inner = model
    for i in range(12):  # a deep tree: the projections' names pass 100 characters
        setattr(inner, f"stage_{i}_blocks", nn.Module())
        inner = getattr(inner, f"stage_{i}_blocks")
    inner.q_proj, inner.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
    config = LoraConfig(r=2, target_modules=["q_proj", "k_proj"], use_dora=True, init_lora_weights=False)
    peft_model = flashdora.enable(get_peft_model(model, config))
    names = [n for n, m in peft_model.named_modules() if n.endswith(("q_proj", "k_proj")) and hasattr(m, "lora_A")]
    assert len(names) == 2 and min(map(len, names)) > 100
    text = flashdora.report(peft_model)
    printed = capsys.readouterr().out
    for name in names:
        assert name in text and name in printed  # whole, on one line: q_proj and k_proj told apart
    assert "DoRA layers by path: flashdora:not run: 2" in printed


def test_report_names_each_layers_dropout_mode():
    model = build_peft_model("tiny", 4, 0.1, "cpu")
    assert "p=0.1 exact" in flashdora.report(model, print_table=False)  # PEFT's own code: its function
    flashdora.enable(model, dropout="adapter")
    text = flashdora.report(model, print_table=False)
    assert text.count("p=0.1 adapter") == 14 and "p=0.1 exact" not in text
    flashdora.enable(model)
    assert flashdora.report(model, print_table=False).count("p=0.1 exact") == 14
    assert flashdora.report(build_peft_model("tiny", 4, 0.0, "cpu"), print_table=False).count(" -\n") == 14


def test_report_of_a_model_never_enabled_says_so_first(capsys):
    model = build_peft_model("tiny", 4, 0.0, "cpu")
    first = flashdora.report(model, print_table=True).splitlines()[0]
    assert first.startswith("flashdora is not enabled on this model") and "flashdora.enable(model)" in first
    assert capsys.readouterr().out.lstrip().startswith("flashdora is not enabled on this model")
    flashdora.enable(model)
    assert flashdora.report(model, print_table=False).splitlines()[0].startswith("module")
    flashdora.disable(model)
    assert "flashdora.enable(model)" in flashdora.report(model, print_table=False).splitlines()[0]
