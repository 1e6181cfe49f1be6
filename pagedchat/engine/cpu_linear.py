"""The matmul of a linear layer, chosen once per model for its dtype and device.

On a CPU without bf16/fp16 instructions torch emulates half-precision matmuls: 16 rows x [576 x 1536]
in bf16 run at ~9 GFLOP/s on the 2-core AVX2 machines, against ~45 in fp32. Widening each bf16 weight
to fp32 just before its matmul keeps the half-sized weights in memory and does the arithmetic where
the CPU is fast; the product is rounded to the layer's dtype once, as a bf16 matmul rounds its fp32
accumulator. Weights larger than `SLICE_ELEMENTS` (the LM head) are widened a slice of rows at a
time, so the fp32 copy stays in cache. For a row or two (one chat decoding alone) widening costs
more than it saves, and torch's own half-precision product (a vectorised dot with fp32
accumulation) is kept.
"""

import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SLICE_ELEMENTS = 1 << 20
MAX_HALF_ROWS = 2

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear_for(dtype: torch.dtype, device: torch.device) -> Linear:
    """`F.linear`, or `widened_linear` where this device would emulate this dtype's matmuls."""
    return widened_linear if widens_matmuls(dtype, device) else F.linear


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for half-precision operands, multiplied in fp32 and rounded once."""
    if x.numel() <= MAX_HALF_ROWS * weight.shape[1]:
        return F.linear(x, weight, bias)
    x32 = x.float()
    rows = max(1, SLICE_ELEMENTS // weight.shape[1])
    out = torch.cat([F.linear(x32, w.float()) for w in weight.split(rows)], dim=-1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def widens_matmuls(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of this dtype multiplies in fp32 on this device (a CPU that emulates half precision)."""
    return device.type == "cpu" and dtype != torch.float32 and not cpu_has_fast_bf16()


@functools.cache
def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: stay with the safe choice
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
