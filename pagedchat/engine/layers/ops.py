"""A layer's matmuls with the ops on either side of them (the norm before, silu(gate) * up before the down
projection, the rotary of q and k or the residual add after): in torch ops around the model's matmul, or,
where cpu_gemm takes the matmul, in its one call, which spares a step the fixed cost of some thirty small
torch ops a layer."""

import torch
import torch.nn.functional as F

from pagedchat.kernels import cpu_gemm
from pagedchat.engine.layers.norm import rms_norm
from pagedchat.engine.layers.plan import KernelPlan
from pagedchat.engine.layers.rotary import rotate


class LayerOps:
    """A layer's products with their neighbouring ops, as the model's kernel plan routes them."""

    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self.linear = plan.linear

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ weight.T + bias"""
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
        if self.plan.fuses(gate_up, weight):
            return cpu_gemm.linear(gate_up, weight, bias, residual=residual, silu=True)
        if self.plan.native_ops(gate_up, weight.shape[1]):
            return residual + self.linear(cpu_gemm.pre_op(gate_up, silu=True), weight, bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self.linear(F.silu(gate) * up, weight, bias)
