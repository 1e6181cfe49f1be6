"""Half-precision linear layers computed in fp32 on CPUs without bf16 instructions."""

import pytest
import torch
from torch import nn

from pagedchat.engine import cpu_linear, loader
from pagedchat.engine.cpu_linear import Float32MatmulLinear, multiply_in_fp32
from pagedchat.engine.loader import load_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_exact_one_rounded_once(dtype, bias, monkeypatch):
    monkeypatch.setattr(cpu_linear, "SLICE_ELEMENTS", 64 * 40)  # 40 rows a slice: 300 rows in 8 slices
    layer = nn.Linear(64, 300, bias=bias, dtype=dtype)
    x = torch.randn(2, 5, 64, dtype=dtype)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(),
                                       None if layer.bias is None else layer.bias.double())
    multiply_in_fp32(layer)
    assert type(layer) is Float32MatmulLinear
    widened = layer(x)
    assert widened.dtype == dtype and widened.shape == (2, 5, 300)
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1)
    assert ((widened.double() - exact).abs() <= ulp).all()  # within one rounding of the exact product
    one_row = x[:1, :1]  # too few rows to gain from widening: torch's own half-precision product
    assert torch.equal(layer(one_row), torch.nn.functional.linear(one_row, layer.weight, layer.bias))


def test_only_half_precision_linears_are_widened():
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.bfloat16), nn.Linear(8, 8), nn.Embedding(4, 8))
    multiply_in_fp32(model)
    assert [type(m) for m in model] == [Float32MatmulLinear, nn.Linear, nn.Embedding]


def test_the_loader_widens_half_models_only_where_the_cpu_lacks_bf16(tiny_model, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "_cpu_has_fast_bf16", lambda: False)
    model, _ = load_model(tiny_model, torch.bfloat16, cpu)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is Float32MatmulLinear for m in linears)
    assert model.lm_head.weight.dtype == torch.bfloat16  # the weights stay half-sized in memory
    model, _ = load_model(tiny_model, torch.float32, cpu)
    assert not any(type(m) is Float32MatmulLinear for m in model.modules())
    monkeypatch.setattr(loader, "_cpu_has_fast_bf16", lambda: True)
    model, _ = load_model(tiny_model, torch.bfloat16, cpu)
    assert not any(type(m) is Float32MatmulLinear for m in model.modules())
