"""The avx512_bf16 matmul of kernels/cpu_gemm_bf16.c, on weights packed for it, built and loaded by
`pagedchat.kernels.native`."""

import functools

import torch
import torch.nn.functional as F

from . import native

PANEL = 32  # the columns of a packed panel, as cpu_gemm_bf16.c reads them


@functools.cache
def kernel() -> native.Kernel | None:
    """`pagedchat_linear_bf16` from the built library; None where the CPU lacks avx512_bf16 or it cannot be
    built. Where it is built, so are `pre_op` and `rotate_`."""
    return native.function("cpu_gemm_bf16.c", "pagedchat_linear_bf16", isa="avx512_bf16")


@functools.cache
def _pre_op_kernel() -> native.Kernel:
    return native.function("cpu_gemm_bf16.c", "pagedchat_pre_op_bf16", isa="avx512_bf16")


@functools.cache
def _rotate_kernel() -> native.Kernel:
    return native.function("cpu_gemm_bf16.c", "pagedchat_rotate_bf16", isa="avx512_bf16")


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as cpu_gemm_bf16.c reads it: panels of PANEL columns (the last padded with zeros), in
    each the depth pairs (2j, 2j + 1) of its columns side by side."""
    width, depth = weight.shape
    padded = F.pad(weight, (0, 0, 0, -width % PANEL))
    return padded.view(-1, PANEL, depth // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, width: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [width, K]^T + bias in bf16, from the weight's `pack`: its products summed in fp32,
    rounded once. The caller checks `supports` and that `kernel()` is built."""
    x = x.contiguous()
    rows, depth = x.shape
    out = x.new_empty(rows, width)
    bias = None if bias is None else bias.float().contiguous()
    kernel()(x.data_ptr(), rows, depth, packed.data_ptr(), width, native.pointer(bias), out.data_ptr(),
             torch.get_num_threads())
    return out


def pre_op(x: torch.Tensor, pre: int, norm_weight: torch.Tensor | None, eps: float, depth: int) -> torch.Tensor:
    """cpu_gemm.pre_op for a contiguous bf16 x, its arguments as cpu_gemm prepared them."""
    out = x.new_empty(x.shape[0], depth)
    _pre_op_kernel()(x.data_ptr(), x.shape[0], depth, pre, native.pointer(norm_weight), eps, out.data_ptr(),
                     torch.get_num_threads())
    return out


def rotate_(y: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, heads: int) -> torch.Tensor:
    """cpu_gemm.rotate_ for a contiguous bf16 y and contiguous bf16 tables."""
    _rotate_kernel()(y.data_ptr(), y.shape[0], y.shape[1], cos.data_ptr(), sin_signed.data_ptr(), heads, cos.shape[1],
                     torch.get_num_threads())
    return y
