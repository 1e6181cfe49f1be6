"""A layer's matmuls with the ops on either side of them (the norm before, silu(gate) * up before the down
projection, the rotary of q and k or the residual add after): in torch ops around the model's matmul, or,
where cpu_gemm takes the matmul, in its one call, which spares a step the fixed cost of some thirty small
torch ops a layer."""

import torch
import torch.nn.functional as F

from pagedchat.engine import cpu_gemm
from pagedchat.engine.cpu_linear import CpuLinear, Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, op for op: in fp32, rounded to x's dtype before the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by its rows' rotary tables [T, D]: transformers' rotary, as
    rotate_half(x) * sin == roll(x, D / 2) * (sin with its first half negated), exactly."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed[:, None]


class LayerOps:
    def __init__(self, linear: Linear):
        self.linear = linear

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ weight.T + bias"""
        if self._fused(x, weight):
            return cpu_gemm.linear(x, weight, bias, residual=residual)
        y = self.linear(x, weight, bias)
        return y if residual is None else residual + y

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None
                    ) -> torch.Tensor:
        """rms_norm(x) @ weight.T + bias, its first heads then rotated by `rotary` (cos, sin_signed, heads)"""
        if self._fused(x, weight):
            return cpu_gemm.linear(x, weight, bias, norm=(norm_weight, eps), rotary=rotary)
        native = self._native(x, x.shape[1])
        y = self.linear(cpu_gemm.pre_op(x, norm=(norm_weight, eps)) if native else rms_norm(x, norm_weight, eps),
                        weight, bias)
        if rotary is None:
            return y
        cos, sin, heads = rotary
        if native and y.is_contiguous():
            return cpu_gemm.rotate_(y, cos, sin, heads)
        rows, dim = y.shape[0], cos.shape[1]
        y[:, : heads * dim] = rotate(y[:, : heads * dim].view(rows, heads, dim), cos, sin).flatten(1)
        return y

    def silu_matmul(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        """residual + (silu(gate) * up) @ weight.T + bias, gate_up = [gate | up]"""
        if self._fused(gate_up, weight):
            return cpu_gemm.linear(gate_up, weight, bias, residual=residual, silu=True)
        if self._native(gate_up, weight.shape[1]):
            return residual + self.linear(cpu_gemm.pre_op(gate_up, silu=True), weight, bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self.linear(F.silu(gate) * up, weight, bias)

    def _fused(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return isinstance(self.linear, CpuLinear) and self.linear.uses_gemm(x, weight)

    def _native(self, x: torch.Tensor, depth: int) -> bool:
        """Whether the ops around a product that cpu_gemm does not take (cpu_gemm_bf16's or oneDNN's, past one
        row on a CPU with avx512f) are the C kernels' alone: one call each, where torch's would be up to ten
        of fixed cost. Not where torch's own product is taken (a few rows without cpu_gemm), which torch's
        ops go around."""
        return (isinstance(self.linear, CpuLinear) and x.shape[0] > self.linear.half_rows
                and cpu_gemm.kernel() is not None and cpu_gemm.takes(x, depth))


TORCH_OPS = LayerOps(F.linear)
