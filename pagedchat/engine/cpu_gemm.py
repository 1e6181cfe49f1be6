"""The AVX2 matmul of kernels/cpu_gemm.c, built and loaded by `pagedchat.kernels.native`."""

import ctypes
import functools

import torch

from pagedchat.kernels import native

KINDS = native.KINDS
PRE_NONE, PRE_RMS_NORM, PRE_SILU_MUL = 0, 1, 2
NEEDED_FLAGS = native.AVX2_CPU_FLAGS
cpu_flags = native.cpu_flags


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """`pagedchat_linear` from the built library; None where the CPU lacks AVX2/FMA/F16C or it cannot be built."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return native.avx2_function("cpu_gemm.c", "pagedchat_linear",
                                [p, i32, i64, i64, i32, p, ctypes.c_float, p, i32, i64, p, p, p, p, p, i64, i64, i32])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in KINDS and weight.dtype in KINDS and weight.is_contiguous()
            and weight.shape[1] % 8 == 0)


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
    norm_weight, eps = (None, 0.0) if norm is None else (norm[0].to(x.dtype).contiguous(), norm[1])
    bias = None if bias is None else bias.float().contiguous()
    residual = None if residual is None else residual.to(x.dtype).contiguous()
    pre = PRE_SILU_MUL if silu else PRE_NONE if norm is None else PRE_RMS_NORM
    cos, sin, heads = (None, None, 0) if rotary is None else rotary
    cos, sin = (None if t is None else t.to(x.dtype).contiguous() for t in (cos, sin))
    kernel()(x.data_ptr(), KINDS[x.dtype], rows, depth, pre, _pointer(norm_weight), eps, weight.data_ptr(),
             KINDS[weight.dtype], width, _pointer(bias), _pointer(residual), out.data_ptr(), _pointer(cos),
             _pointer(sin), heads, 0 if cos is None else cos.shape[1], torch.get_num_threads())
    return out


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
