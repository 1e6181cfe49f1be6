"""The matmul of a linear layer on the CPU, chosen once per model for its dtype and the CPU.

Measured on the 2-core AVX2 machines, the default model's 30 layers at 1 / 2 / 16 rows:
- fp32: oneDNN's matmul on a weight reordered for it once ran 27 / 29 / 48 ms, torch's `F.linear`
  (MKL) 36 / 73 / 69 ms; so fp32 layers use oneDNN, on a copy of each weight made at its first use.
- bf16 on a CPU without bf16 instructions (torch emulates the product, at a cost that grows with every
  row: 16 / 28 / 199 ms): for one or two rows (one chat decoding) the emulated product is the fastest
  there is, a vectorised dot with fp32 accumulation that reads the half-sized weights once; for more
  rows the layer multiplies in fp32 through oneDNN as above, on an fp32 copy of the weight made the
  first time a batch needs it. The product is rounded to bf16 once, as a bf16 matmul rounds its fp32
  accumulator.
- bf16 with bf16 instructions (avx512_bf16, AMX): torch's own product, which calls oneDNN itself.
The copies double the weights' memory of a model that uses them (an fp32 model, or a bf16 one that ever
runs a batch on a CPU without bf16): the price of 1.3-4x faster matmuls.
"""

import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_HALF_ROWS = 2
REORDER_BATCH_HINT = 64  # the batch size oneDNN lays a reordered weight out for; any batch may use it

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear_for(dtype: torch.dtype, device: torch.device) -> Linear:
    """The matmul for a model of this dtype on this device (see the module's docstring)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return F.linear
    if dtype == torch.float32:
        return OneDnnLinear(half_rows=0)
    if widens_matmuls(dtype, device):
        return OneDnnLinear(half_rows=MAX_HALF_ROWS)
    return F.linear


class OneDnnLinear:
    """x @ weight.T + bias through oneDNN in fp32, on weights reordered for it at their first use; inputs
    of up to `half_rows` rows keep torch's own product on the weight as it is.

    One instance serves one model: the reordered copies are keyed by the identity of weights that the
    model holds for as long as it lives."""

    def __init__(self, half_rows: int) -> None:
        self.half_rows = half_rows
        self.reordered: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() <= self.half_rows * weight.shape[1]:
            return F.linear(x, weight, bias)
        packed = self.reordered.get(id(weight))
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), REORDER_BATCH_HINT)
            self.reordered[id(weight)] = packed
        out = torch.ops.mkldnn._linear_pointwise(x.float(), packed, None if bias is None else bias.float(),
                                                 "none", [], "")
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
