import pytest
import torch

from flashdora.reference import dora_linear_ref, row_norm_ref
from tests.helpers import dora_inputs


def test_row_norm_ref_is_the_textbook_row_norm():
    i = dora_inputs(9, 5, 3, dtype=torch.float64)
    dense = i["weight"] + i["scaling"] * i["lora_B"] @ i["lora_A"]
    expected = torch.stack([torch.sqrt((row * row).sum()) for row in dense])
    torch.testing.assert_close(row_norm_ref(i["weight"], i["lora_A"], i["lora_B"], i["scaling"]), expected)


def test_dora_ref_equals_the_decomposed_weight():
    # DoRA: W' = m * V / ||V||_row with V = W + s B A, so y = x W'^T + bias when there is no dropout.
    i = dora_inputs(11, 7, 4, dtype=torch.float64)
    v = i["weight"] + i["scaling"] * i["lora_B"] @ i["lora_A"]
    w_prime = i["magnitude"].double()[:, None] * v / v.norm(dim=1, keepdim=True)
    expected = i["x"] @ w_prime.T + i["bias"]
    out = dora_linear_ref(
        i["x"], i["weight"], i["bias"], i["lora_A"], i["lora_B"], i["magnitude"].double(), i["scaling"]
    )
    torch.testing.assert_close(out, expected)


def test_dora_ref_with_lora_x_equal_to_x_is_the_plain_form():
    i = dora_inputs(6, 4, 2, dtype=torch.float64)
    args = (i["x"], i["weight"], i["bias"], i["lora_A"], i["lora_B"], i["magnitude"].double(), i["scaling"])
    torch.testing.assert_close(dora_linear_ref(*args, lora_x=i["x"]), dora_linear_ref(*args))


@pytest.mark.parametrize("with_lora_x", [False, True], ids=["plain", "lora_x"])
def test_dora_ref_gradcheck(with_lora_x):
    i = dora_inputs(5, 4, 2, lead=(3,), dtype=torch.float64)
    x = i["x"].requires_grad_()
    m = i["magnitude"].double().requires_grad_()
    lora_x = torch.randn_like(x).requires_grad_() if with_lora_x else None
    f = lambda x, m, lx: dora_linear_ref(x, i["weight"], i["bias"], i["lora_A"], i["lora_B"], m, i["scaling"], lx)
    assert torch.autograd.gradcheck(f, (x, m, lora_x))
