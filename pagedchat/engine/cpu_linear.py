"""Half-precision linear layers that multiply in fp32, for CPUs without bf16/fp16 instructions.

On such a CPU torch emulates half-precision matmuls: 16 rows x [576 x 1536] in bf16 run at ~9
GFLOP/s on the 2-core AVX2 machines, against ~45 in fp32. A decode step is bound by streaming the
weights from memory, so fp32 weights are no answer either. Widening each bf16 weight to fp32 just
before its matmul keeps the half-sized weights in memory and does the arithmetic where the CPU is
fast; the product is rounded to the layer's dtype once, as a bf16 matmul rounds its fp32
accumulator. Weights larger than `SLICE_ELEMENTS` (the LM head) are widened a slice of rows at a
time, so the fp32 copy stays in cache.
"""

import torch
import torch.nn.functional as F
from torch import nn

SLICE_ELEMENTS = 1 << 20


class Float32MatmulLinear(nn.Linear):
    """nn.Linear holding half-precision parameters, computed in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
