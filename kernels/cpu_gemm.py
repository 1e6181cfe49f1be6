"""The AVX2 matmul of kernels/cpu_gemm.c, built and loaded by `pagedchat.kernels.native`."""

import functools

import torch

from . import cpu_gemm_bf16
from . import native

KINDS = native.KINDS
PRE_NONE, PRE_RMS_NORM, PRE_SILU_MUL = 0, 1, 2
NEEDED_FLAGS = native.AVX2_CPU_FLAGS
cpu_flags = native.cpu_flags


@functools.cache
def kernel() -> native.Kernel | None:
    """`pagedchat_linear` from the built library; None where the CPU lacks AVX2/FMA/F16C or it cannot be built.
    Where it is built, so are `pre_op` and `rotate_`."""
    return native.function("cpu_gemm.c", "pagedchat_linear")


@functools.cache
def _pre_op_kernel() -> native.Kernel:
    return native.function("cpu_gemm.c", "pagedchat_pre_op")


@functools.cache
def _rotate_kernel() -> native.Kernel:
    return native.function("cpu_gemm.c", "pagedchat_rotate")


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return takes(x, weight.shape[1]) and weight.dtype in KINDS and weight.is_contiguous()


def takes(x: torch.Tensor, depth: int) -> bool:
    """Whether the kernels take x as the input of a product of this depth."""
    return x.device.type == "cpu" and x.dtype in KINDS and depth % 8 == 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
           silu: bool = False, rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """residual + pre(x) [M, K] @ weight [N, K]^T + bias, multiplied in fp32 on the weight as it is and rounded
    to x's dtype; pre is transformers' RMSNorm by `norm` (its weight, eps), or, with `silu`, x is
    [gate | up] [M, 2K] and pre(x) = silu(gate) * up; with `rotary` (cos, sin_signed [M, D], heads), the
    first heads of D of each row are then rotated as `layer_ops.rotate` does. The caller checks `supports`
    and that `kernel()` is built."""
    x = x.contiguous()
    (rows, depth), width = x.shape, weight.shape[0]
    depth //= 2 if silu else 1
    out = x.new_empty(rows, width)
    norm_weight, eps = _norm_arguments(norm, x.dtype)
    bias = None if bias is None else bias.float().contiguous()
    residual = None if residual is None else residual.to(x.dtype).contiguous()
    cos, sin, heads = (None, None, 0) if rotary is None else rotary
    cos, sin = (None if t is None else t.to(x.dtype).contiguous() for t in (cos, sin))
    kernel()(x.data_ptr(), KINDS[x.dtype], rows, depth, _pre(norm, silu), native.pointer(norm_weight), eps,
             weight.data_ptr(), KINDS[weight.dtype], width, native.pointer(bias), native.pointer(residual), out.data_ptr(),
             native.pointer(cos), native.pointer(sin), heads, 0 if cos is None else cos.shape[1], torch.get_num_threads())
    return out


def pre_op(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, silu: bool = False) -> torch.Tensor:
    """The pre-op of `linear` alone, in x's dtype, for a product that another library takes: [M, K] from x
    [M, K] (the norm) or [M, 2K] (silu); bf16 on a CPU with avx512_bf16 by cpu_gemm_bf16.c's, 16 lanes at a
    time. The caller checks `takes` for K and that `kernel()` is built."""
    x = x.contiguous()
    rows, depth = x.shape
    depth //= 2 if silu else 1
    norm_weight, eps = _norm_arguments(norm, x.dtype)
    if x.dtype == torch.bfloat16 and cpu_gemm_bf16.kernel() is not None:
        return cpu_gemm_bf16.pre_op(x, _pre(norm, silu), norm_weight, eps, depth)
    out = x.new_empty(rows, depth)
    _pre_op_kernel()(x.data_ptr(), KINDS[x.dtype], rows, depth, _pre(norm, silu), native.pointer(norm_weight), eps,
                     out.data_ptr(), torch.get_num_threads())
    return out


def rotate_(y: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, heads: int) -> torch.Tensor:
    """y [M, N] (contiguous), its first heads of D rotated in place as `linear` rotates them (bf16 as
    `pre_op` does it)."""
    assert y.is_contiguous() and y.dtype in KINDS
    cos, sin_signed = (t.to(y.dtype).contiguous() for t in (cos, sin_signed))
    if y.dtype == torch.bfloat16 and cpu_gemm_bf16.kernel() is not None:
        return cpu_gemm_bf16.rotate_(y, cos, sin_signed, heads)
    _rotate_kernel()(y.data_ptr(), KINDS[y.dtype], y.shape[0], y.shape[1], cos.data_ptr(), sin_signed.data_ptr(),
                     heads, cos.shape[1], torch.get_num_threads())
    return y


def _pre(norm: tuple[torch.Tensor, float] | None, silu: bool) -> int:
    return PRE_SILU_MUL if silu else PRE_NONE if norm is None else PRE_RMS_NORM


def _norm_arguments(norm: tuple[torch.Tensor, float] | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else (norm[0].to(dtype).contiguous(), norm[1])

