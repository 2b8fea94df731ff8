import pytest

import flashdora
from flashdora.demo import build_peft_model


def test_report_lists_every_dora_layer_with_its_path(capsys):
    model = build_peft_model("tiny", 4, 0.0, "cpu")
    text = flashdora.report(model, print_table=False)
    assert text.count(" peft\n") + text.rstrip().count(" peft") >= 14
    assert "DoRA layers by path: peft: 14" in text
    flashdora.enable(model)
    flashdora.reset_stats()
    text = flashdora.report(model, print_table=True)
    assert "DoRA layers by path: flashdora:eager: 14" in text
    assert "layers.1.mlp.down_proj" in text
    printed = capsys.readouterr().out
    assert "flashdora report" in printed and "flashdora:eager" in printed


def test_report_shows_the_counters():
    model = flashdora.enable(build_peft_model("tiny", 4, 0.0, "cpu"))
    flashdora.reset_stats()
    import torch

    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 4)))
    assert "calls since reset_stats(): {'eager': 14, 'norm:eager': 14}" in flashdora.report(model, print_table=False)


def test_report_of_a_model_without_dora():
    import torch

    assert "no DoRA layers found" in flashdora.report(torch.nn.Linear(2, 2), print_table=False)
    with pytest.raises(TypeError, match="report: model expected a torch.nn.Module"):
        flashdora.report(42)
