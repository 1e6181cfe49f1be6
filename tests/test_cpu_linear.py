"""Half-precision matmuls computed in fp32 on CPUs without bf16 instructions."""

import pytest
import torch
import torch.nn.functional as F

from pagedchat.engine import cpu_linear
from pagedchat.engine.cpu_linear import linear_for, widened_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_exact_one_rounded_once(dtype, bias, monkeypatch):
    monkeypatch.setattr(cpu_linear, "SLICE_ELEMENTS", 64 * 40)  # 40 rows a slice: 300 rows in 8 slices
    weight = torch.randn(300, 64, dtype=dtype)
    b = torch.randn(300, dtype=dtype) if bias else None
    x = torch.randn(5, 64, dtype=dtype)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    widened = widened_linear(x, weight, b)
    assert widened.dtype == dtype and widened.shape == (5, 300)
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1)
    assert ((widened.double() - exact).abs() <= ulp).all()  # within one rounding of the exact product
    one_row = x[:1]  # too few rows to gain from widening: torch's own half-precision product
    assert torch.equal(widened_linear(one_row, weight, b), F.linear(one_row, weight, b))


def test_half_precision_widens_only_where_the_cpu_lacks_bf16(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: False)
    assert linear_for(torch.bfloat16, cpu) is widened_linear
    assert linear_for(torch.float32, cpu) is F.linear
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: True)
    assert linear_for(torch.bfloat16, cpu) is F.linear
