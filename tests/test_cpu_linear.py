"""The CPU matmuls: oneDNN on reordered fp32 weights, torch's own product for a row or two of bf16."""

import pytest
import torch
import torch.nn.functional as F

from pagedchat.engine import cpu_linear
from pagedchat.engine.cpu_linear import OneDnnLinear, linear_for


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_exact_one_rounded_once(dtype, bias):
    linear = OneDnnLinear(half_rows=2)
    weight = torch.randn(300, 64, dtype=dtype)
    b = torch.randn(300, dtype=dtype) if bias else None
    x = torch.randn(5, 64, dtype=dtype)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    product = linear(x, weight, b)
    assert product.dtype == dtype and product.shape == (5, 300)
    # within one rounding of the exact product (fp32: a few ulps of accumulation order)
    ulp = max(torch.finfo(dtype).eps, 1e-6) * exact.abs().clamp_min(1) * (1 if dtype != torch.float32 else 8)
    assert ((product.double() - exact).abs() <= ulp).all()
    assert len(linear.reordered) == 1  # reordered once, kept
    assert torch.equal(linear(x, weight, b), product)
    two_rows = x[:2]  # too few rows to gain from fp32: torch's own product on the weight as it is
    assert torch.equal(linear(two_rows, weight, b), F.linear(two_rows, weight, b))


def test_the_matmul_follows_the_dtype_and_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: False)
    assert linear_for(torch.bfloat16, cpu).half_rows == cpu_linear.MAX_HALF_ROWS
    assert linear_for(torch.float32, cpu).half_rows == 0
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: True)
    assert linear_for(torch.bfloat16, cpu) is F.linear
    assert linear_for(torch.float32, torch.device("meta")) is F.linear
