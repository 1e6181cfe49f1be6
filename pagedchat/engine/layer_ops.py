"""A layer's matmuls with the ops on either side of them (the norm before, silu(gate) * up before the down
projection, the residual add after): in torch ops around the model's matmul, or, where cpu_gemm takes the
matmul, in its one call, which spares a step the fixed cost of some thirty small torch ops a layer."""

import torch
import torch.nn.functional as F

from pagedchat.engine import cpu_gemm
from pagedchat.engine.cpu_linear import Linear, WidenedLinear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, op for op: in fp32, rounded to x's dtype before the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LayerOps:
    def __init__(self, linear: Linear):
        self.linear = linear
        self.gemm = isinstance(linear, WidenedLinear) and linear.gemm

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ weight.T + bias"""
        if self._fused(x, weight):
            return cpu_gemm.linear(x, weight, bias, residual=residual)
        y = self.linear(x, weight, bias)
        return y if residual is None else residual + y

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """rms_norm(x) @ weight.T + bias"""
        if self._fused(x, weight):
            return cpu_gemm.linear(x, weight, bias, norm=(norm_weight, eps))
        return self.linear(rms_norm(x, norm_weight, eps), weight, bias)

    def silu_matmul(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        """residual + (silu(gate) * up) @ weight.T + bias, gate_up = [gate | up]"""
        if self._fused(gate_up, weight):
            return cpu_gemm.linear(gate_up, weight, bias, residual=residual, silu=True)
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self.linear(F.silu(gate) * up, weight, bias)

    def _fused(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.gemm and x.shape[0] > self.linear.half_rows and cpu_gemm.supports(x, weight)


TORCH_OPS = LayerOps(F.linear)
