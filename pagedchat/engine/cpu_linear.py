"""Half-precision linear layers that multiply in fp32, for CPUs without bf16/fp16 instructions.

On such a CPU torch emulates half-precision matmuls: 16 rows x [576 x 1536] in bf16 run at ~9
GFLOP/s on the 2-core AVX2 machines, against ~45 in fp32. Widening each bf16 weight to fp32 just
before its matmul keeps the half-sized weights in memory and does the arithmetic where the CPU is
fast (faster, at 16 rows, than a model held in fp32: 319 against 379 ms a decode step); the product is rounded to the layer's dtype once, as a bf16 matmul rounds its fp32
accumulator. Weights larger than `SLICE_ELEMENTS` (the LM head) are widened a slice of rows at a
time, so the fp32 copy stays in cache. For a row or two (one chat decoding alone) widening costs
more than it saves, and torch's own half-precision product is kept: a decode step of the default
model at 1 / 4 / 16 rows took 69 / 201 / 675 ms in torch's bf16, 124 / 181 / 319 ms widened.
"""

import torch
import torch.nn.functional as F
from torch import nn

SLICE_ELEMENTS = 1 << 20
MAX_HALF_ROWS = 2


class Float32MatmulLinear(nn.Linear):
    """nn.Linear holding half-precision parameters, computed in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= MAX_HALF_ROWS * self.in_features:
            return super().forward(x)
        x32 = x.float()
        rows = max(1, SLICE_ELEMENTS // self.in_features)
        out = torch.cat([F.linear(x32, w.float()) for w in self.weight.split(rows)], dim=-1)
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype)


def multiply_in_fp32(model: nn.Module) -> None:
    """Make every half-precision nn.Linear of `model` compute in fp32 (in place, parameters kept)."""
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype in (torch.bfloat16, torch.float16):
            module.__class__ = Float32MatmulLinear
