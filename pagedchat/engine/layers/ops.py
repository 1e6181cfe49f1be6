"""A layer's matmuls with the ops on either side of them (the norm before, silu(gate) * up before the down
projection, the rotary of q and k or the residual add after): in torch ops around the model's matmul, or,
where cpu_gemm takes the matmul, in its one call, which spares a step the fixed cost of some thirty small
torch ops a layer. A GGUF's matrices (`ColumnProduct`) are multiplied where they lie, the ops around them
cpu_gemm's where it is built."""

import torch
import torch.nn.functional as F

from pagedchat.kernels import cpu_gemm
from pagedchat.engine.layers.norm import rms_norm
from pagedchat.engine.layers.plan import KernelPlan
from pagedchat.engine.layers.quantized import ColumnProduct
from pagedchat.engine.layers.rotary import rotate


class LayerOps:
    """A layer's products with their neighbouring ops, as the model's kernel plan routes them."""

    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self.linear = plan.linear

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ weight.T + bias"""
        if isinstance(weight, ColumnProduct):
            return _plus(_plus(weight(x), bias), residual)
        if self.plan.fuses(x, weight):
            return cpu_gemm.linear(x, weight, bias, residual=residual)
        y = self.linear(x, weight, bias)
        return y if residual is None else residual + y

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None
                    ) -> torch.Tensor:
        """rms_norm(x) @ weight.T + bias, its first heads then rotated by `rotary` (cos, sin_signed, heads)"""
        if self.plan.fuses(x, weight):
            return cpu_gemm.linear(x, weight, bias, norm=(norm_weight, eps), rotary=rotary)
        native = self.plan.native_ops(x, x.shape[1])
        normed = cpu_gemm.pre_op(x, norm=(norm_weight, eps)) if native else rms_norm(x, norm_weight, eps)
        if isinstance(weight, ColumnProduct):
            y = _plus(weight(normed), bias)
        else:
            y = self.linear(normed, weight, bias)
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
        if self.plan.fuses(gate_up, weight):
            return cpu_gemm.linear(gate_up, weight, bias, residual=residual, silu=True)
        if self.plan.native_ops(gate_up, weight.shape[1]):
            hidden = cpu_gemm.pre_op(gate_up, silu=True)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        if isinstance(weight, ColumnProduct):
            return _plus(_plus(weight(hidden), bias), residual)
        return residual + self.linear(hidden, weight, bias)


def _plus(y: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """y + other, into y: a product's fresh output."""
    return y if other is None else y.add_(other)
