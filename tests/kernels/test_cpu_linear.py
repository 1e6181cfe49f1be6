"""The CPU matmuls: pagedchat's AVX2 kernel (cpu_gemm.c) in fp32, its avx512_bf16 kernel (cpu_gemm_bf16.c),
oneDNN in fp32 or natively in bf16, each rounded once, and torch's own product for a row or two of bf16."""

import functools
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from pagedchat.kernels import cpu_attention, cpu_gemm, cpu_gemm_bf16, native

from pagedchat.engine.layers import linear as cpu_linear
from pagedchat.engine.layers.linear import CpuLinear, linear_for
from pagedchat.engine.layers.norm import rms_norm
from pagedchat.engine.layers.ops import LayerOps
from pagedchat.engine.layers.plan import KernelPlan, plan_for, torch_plan
from pagedchat.engine.layers.rotary import rotate

CPU = torch.device("cpu")


def ops_of(linear: CpuLinear, dtype: torch.dtype) -> LayerOps:
    return LayerOps(KernelPlan(dtype, CPU, linear, "torch"))

needs_gemm = pytest.mark.skipif(not cpu_gemm.NEEDED_FLAGS <= cpu_gemm.cpu_flags(),
                                reason="the CPU lacks AVX2, FMA or F16C")


def within_accumulation_error(product: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None) -> bool:
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # fp32 sums of K products: a few ulps of each product's size, whatever the order
    scale = F.linear(x.double().abs(), weight.double().abs()) + (0 if bias is None else bias.double().abs())
    return bool(((product.double() - exact).abs() <= 1e-6 * x.shape[1] ** 0.5 * scale + 1e-30).all())


@needs_gemm
def test_the_kernel_builds_where_the_cpu_has_avx2():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    assert cpu_gemm.kernel() is not None


@needs_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("width, depth", [(259, 64), (964, 1536), (6, 520)])  # a partial block; past one scratch
def test_the_kernel_is_the_fp32_product(dtype, rows, width, depth):
    if cpu_gemm.kernel() is None:
        pytest.skip("no C compiler")
    weight = torch.randn(width, depth).to(dtype)
    x = torch.randn(rows, depth)
    bias = torch.randn(width) if rows % 2 else None
    product = cpu_gemm.linear(x, weight, bias)
    assert product.dtype == torch.float32 and product.shape == (rows, width)
    assert within_accumulation_error(product, x, weight, bias)


@pytest.mark.parametrize("gemm", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_exact_one_rounded_once(dtype, bias, gemm):
    if gemm and cpu_gemm.kernel() is None:
        pytest.skip("no AVX2 kernel on this machine")
    linear = CpuLinear(half_rows=2, gemm_rows=math.inf if gemm else 0)
    weight = torch.randn(300, 64, dtype=dtype)
    b = torch.randn(300, dtype=dtype) if bias else None
    x = torch.randn(5, 64, dtype=dtype)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    product = linear(x, weight, b)
    assert product.dtype == dtype and product.shape == (5, 300)
    # within one rounding of the exact product (fp32: a few ulps of accumulation order)
    ulp = max(torch.finfo(dtype).eps, 1e-6) * exact.abs().clamp_min(1) * (1 if dtype != torch.float32 else 8)
    assert ((product.double() - exact).abs() <= ulp).all()
    assert len(linear.onednn.reordered) == (0 if gemm else 1)  # oneDNN's copy: made once, kept
    assert torch.equal(linear(x, weight, b), product)
    two_rows = x[:2]  # too few rows to gain from fp32: torch's own product on the weight as it is
    assert torch.equal(linear(two_rows, weight, b), F.linear(two_rows, weight, b))


@needs_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("gemm_rows", [math.inf, 1])
def test_the_fused_ops_are_torch_ops_around_the_exact_product(dtype, rows, gemm_rows):
    """cpu_gemm's norm before, silu(gate) * up before and residual add after the product, against torch's ops
    around a float64 product: within a rounding or two of the output and of each input (the fp32 sums of
    a norm may round an input the other way); its rotary after the product, against torch's rotary on
    the product, exactly. The same where oneDNN takes the product (gemm_rows 1) and cpu_gemm.c the ops
    around it alone."""
    if cpu_gemm.kernel() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(rows)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    depth, width = 264, 100
    x, gate_up, residual = randn(rows, depth, scale=3), randn(rows, 2 * depth, scale=2), randn(rows, width)
    norm_weight, weight, bias = 1 + randn(depth, scale=0.1), randn(width, depth, scale=0.1), randn(width)
    ops = ops_of(CpuLinear(half_rows=0, gemm_rows=gemm_rows), dtype)

    def close(fused, inputs, plus):
        exact = plus.double() + F.linear(inputs.double(), weight.double(), bias.double())
        scale = F.linear(inputs.double().abs(), weight.double().abs()) + plus.double().abs() + bias.double().abs()
        eps = max(torch.finfo(dtype).eps, 1e-6)
        return fused.dtype == dtype and bool(((fused.double() - exact).abs() <= 2 * eps * scale).all())

    gate, up = gate_up.chunk(2, dim=-1)
    no_residual = torch.zeros(rows, width, dtype=dtype)
    assert close(ops.norm_matmul(x, norm_weight, 1e-6, weight, bias), rms_norm(x, norm_weight, 1e-6), no_residual)
    assert close(ops.silu_matmul(gate_up, weight, bias, residual), F.silu(gate) * up, residual)
    assert close(ops.matmul(x, weight, bias, residual), x, residual)
    assert not close(ops.norm_matmul(x, norm_weight, 1e-6, weight, bias), x, no_residual)  # the norm is done
    cos, sin = randn(rows, 24), randn(rows, 24)  # rotary tables for the first 4 heads of 24 columns
    plain = ops.norm_matmul(x, norm_weight, 1e-6, weight, bias)
    rotated = ops.norm_matmul(x, norm_weight, 1e-6, weight, bias, rotary=(cos, sin, 4))
    assert torch.equal(rotated[:, :96], rotate(plain[:, :96].view(rows, 4, 24), cos, sin).flatten(1))
    assert torch.equal(rotated[:, 96:], plain[:, 96:])
    unfused = ops_of(CpuLinear(half_rows=rows, gemm_rows=math.inf), dtype)  # too few rows: torch's ops, as they are
    assert torch.equal(unfused.silu_matmul(gate_up, weight, bias, residual),
                       LayerOps(torch_plan(dtype, CPU)).silu_matmul(gate_up, weight, bias, residual))
    assert torch.equal(unfused.norm_matmul(x, norm_weight, 1e-6, weight, bias, rotary=(cos, sin, 4)),
                       LayerOps(torch_plan(dtype, CPU)).norm_matmul(x, norm_weight, 1e-6, weight, bias, rotary=(cos, sin, 4)))


def test_a_weight_the_kernel_does_not_take_goes_to_onednn():
    linear = CpuLinear(half_rows=0, gemm_rows=math.inf)
    weight = torch.randn(40, 30)  # a depth that is no multiple of 8
    x = torch.randn(3, 30)
    assert within_accumulation_error(linear(x, weight), x, weight, None)
    assert len(linear.onednn.reordered) == 1


def routes(linear) -> tuple:
    return linear.half_rows, linear.gemm_rows, linear.onednn.dtype, linear.packed_bf16 is not None


def test_the_matmul_follows_the_dtype_and_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: object())
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu_gemm_bf16, "kernel", lambda: object())
    assert routes(linear_for(torch.bfloat16, cpu)) == (0, math.inf, torch.float32, False)
    assert routes(linear_for(torch.float32, cpu)) == (0, math.inf, torch.float32, False)
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f"}))
    assert routes(linear_for(torch.float32, cpu)) == (0, 1, torch.float32, False)  # oneDNN's AVX-512 past one row
    assert routes(linear_for(torch.bfloat16, cpu)) == (0, math.inf, torch.float32, False)
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: True)
    # cpu_gemm_bf16 past one row
    assert routes(linear_for(torch.bfloat16, cpu)) == (0, 1, torch.bfloat16, True)
    assert linear_for(torch.float16, cpu) is F.linear
    assert routes(linear_for(torch.float32, cpu)) == (0, 1, torch.float32, False)
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "amx_bf16"}))
    assert routes(linear_for(torch.bfloat16, cpu)) == (0, 1, torch.bfloat16, False)  # oneDNN's, which takes AMX
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f"}))
    monkeypatch.setattr(cpu_gemm_bf16, "kernel", lambda: None)
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: None)  # no compiler
    assert routes(linear_for(torch.bfloat16, cpu)) == (0, 0, torch.bfloat16, False)
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: False)
    assert routes(linear_for(torch.bfloat16, cpu)) == (cpu_linear.MAX_HALF_ROWS, 0, torch.float32, False)
    assert linear_for(torch.float32, torch.device("meta")) is F.linear


@pytest.mark.skipif(not cpu_linear.cpu_has_fast_bf16(), reason="oneDNN's bf16 product needs bf16 instructions")
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_the_native_bf16_product_is_the_exact_one_rounded_once(rows):
    """Where the CPU has bf16 instructions, oneDNN multiplies bf16 as it is, accumulating in fp32."""
    linear = CpuLinear(half_rows=0, gemm_rows=0, onednn_dtype=torch.bfloat16)
    weight = torch.randn(300, 576, dtype=torch.bfloat16)
    bias = torch.randn(300, dtype=torch.bfloat16)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    product = linear(x, weight, bias)
    assert product.dtype == torch.bfloat16 and product.shape == (rows, 300)
    exact = F.linear(x.double(), weight.double(), bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs()) + bias.double().abs()
    # one bf16 rounding of the result, plus fp32 accumulation over 576 products
    assert ((product.double() - exact).abs() <= torch.finfo(torch.bfloat16).eps * exact.abs() + 1e-5 * scale).all()
    assert len(linear.onednn.reordered) == 1


@pytest.mark.skipif(cpu_gemm_bf16.kernel() is None, reason="the CPU lacks avx512_bf16 (or no C compiler)")
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 16, 40])
@pytest.mark.parametrize("width, depth", [(300, 576), (70, 200), (33, 1538)])  # partial panels; odd pairs
def test_the_packed_bf16_product_is_the_exact_one_rounded_once(rows, width, depth):
    """cpu_gemm_bf16.c on its packed weight: within one bf16 rounding of the exact product plus the fp32
    accumulation; the packed copy made once, and no oneDNN copy."""
    gen = torch.Generator().manual_seed(rows * width)
    weight = torch.randn(width, depth, generator=gen).bfloat16()
    bias = torch.randn(width, generator=gen).bfloat16()
    x = torch.randn(rows, depth, generator=gen).bfloat16()
    linear = CpuLinear(half_rows=0, gemm_rows=0, onednn_dtype=torch.bfloat16, packed_bf16=True)
    product = linear(x, weight, bias)
    assert product.dtype == torch.bfloat16 and product.shape == (rows, width)
    exact = F.linear(x.double(), weight.double(), bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs()) + bias.double().abs()
    assert ((product.double() - exact).abs() <= torch.finfo(torch.bfloat16).eps * exact.abs() + 1e-5 * scale).all()
    assert len(linear.packed_bf16.reordered) == 1 and not linear.onednn.reordered
    assert torch.equal(linear(x, weight, bias), product)


def test_the_plan_says_in_one_line_what_runs(monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_has_fast_bf16", lambda: False)
    bf16 = plan_for(torch.bfloat16, CPU, "torch")
    if cpu_gemm.kernel() is not None:
        assert bf16.describe().startswith("bf16 on ")
        assert ": 1+ rows cpu_gemm; decode attention cpu_attention" in bf16.describe(), bf16.describe()
        assert not bf16.one_row_is_torch_product
    assert plan_for(torch.float16, torch.device("meta"), "triton").describe() == \
        "fp16 on meta: torch's product; decode attention triton"
    assert torch_plan(torch.float32, CPU).one_row_is_torch_product


def test_a_kernel_that_cannot_be_built_is_named_with_its_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no library built before
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setattr(native, "_problems", {})
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(native.AVX2_CPU_FLAGS))
    # fresh caches for the test, so that the kernels it finds missing stay missing only inside it
    for module, name in ((native, "library"), (cpu_gemm, "kernel"), (cpu_gemm_bf16, "kernel"),
                         (cpu_attention, "kernel"), (cpu_attention, "kernel_bf16")):
        monkeypatch.setattr(module, name, functools.cache(getattr(module, name).__wrapped__))
    line = plan_for(torch.float32, CPU, "torch").describe()
    assert "cpu_gemm.c not built (no C compiler (cc or gcc) on PATH: install gcc): torch stands in" in line, line


def test_kernel_signatures_come_from_the_c_prototypes():
    result, arguments = native.prototype(native.HERE / "cpu_gemm.c", "pagedchat_linear")
    assert len(arguments) == 18 and result is not None  # returns 0, or 1 out of memory
    kernel = cpu_gemm.kernel()
    if kernel is not None:
        with pytest.raises(TypeError):
            kernel(0, 0)  # ctypes refuses a call that does not match the prototype
