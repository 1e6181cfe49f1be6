"""The matmul of a linear layer on the CPU, chosen once per model (by the kernel plan) for its dtype and the CPU.

- bf16 on a CPU without bf16 instructions: torch emulates the half-precision product at a cost that grows with
  every row, and oneDNN on fp32 copies doubles the model's memory; so pagedchat's own AVX2 matmul
  (cpu_gemm.c) takes every row count, widening the bf16 weights in registers. Without it, torch's product for
  up to two rows, oneDNN past that.
- bf16 with avx512_bf16 (no AMX): cpu_gemm for one row (whose neighbouring ops it also fuses),
  cpu_gemm_bf16.c on weights packed for it past that; with AMX, oneDNN's product, which takes AMX.
- fp32: cpu_gemm (for one row only where the CPU has avx512f, oneDNN past it). fp16 with bf16 instructions:
  torch's own product.
A half-precision product is rounded to the model's dtype once, as a bf16 matmul rounds its fp32 accumulator.
The packed and the reordered copies are made at a weight's first use; a model keeps one of them beside its
own weights. The measurements behind these choices are in bench/RESULTS.md ("Matmul routes by CPU").
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedchat.kernels import cpu_gemm, cpu_gemm_bf16

MAX_HALF_ROWS = 2
REORDER_BATCH_HINT = 64  # the batch size oneDNN lays a reordered weight out for; any batch may use it

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear_for(dtype: torch.dtype, device: torch.device) -> Linear:
    """The matmul for a model of this dtype on this device (see the module's docstring)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return F.linear
    gemm = cpu_gemm.kernel() is not None
    if dtype == torch.bfloat16 and cpu_has_fast_bf16():
        # where AMX multiplies, oneDNN's product (which takes it) stays: on a 2-core AMX Xeon, 16 bf16 chats
        # made 351-429 tokens/s through it against 264-301 through cpu_gemm_bf16 (LLM.generate, 16 x 128)
        packed = "amx_bf16" not in cpu_gemm.cpu_flags() and cpu_gemm_bf16.kernel() is not None
        return CpuLinear(half_rows=0, gemm_rows=1 if gemm else 0, onednn_dtype=torch.bfloat16, packed_bf16=packed)
    if dtype != torch.float32 and cpu_has_fast_bf16():
        return F.linear
    if dtype == torch.float32 and "avx512f" in cpu_gemm.cpu_flags():
        return CpuLinear(half_rows=0, gemm_rows=1 if gemm else 0)
    half_rows = 0 if dtype == torch.float32 or gemm else MAX_HALF_ROWS
    return CpuLinear(half_rows, gemm_rows=math.inf if gemm else 0)


class OneDnnProduct:
    """x @ weight.T + bias in `dtype` through oneDNN (fp32: on widened copies of half-precision weights), on
    copies of the weights reordered for it at their first use, keyed by the identity of weights that the
    model holds for as long as it lives."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.reordered: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = self.reordered.get(id(weight))
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype), REORDER_BATCH_HINT)
            self.reordered[id(weight)] = packed
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), packed,
                                                  None if bias is None else bias.to(self.dtype), "none", [], "")


class PackedBf16Product:
    """x @ weight.T + bias of bf16 tensors by cpu_gemm_bf16.c, on copies of the weights packed for it at their
    first use, keyed like OneDnnProduct's."""

    def __init__(self) -> None:
        self.reordered: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = self.reordered.get(id(weight))
        if packed is None:
            packed = self.reordered[id(weight)] = cpu_gemm_bf16.pack(weight)
        return cpu_gemm_bf16.linear(x, packed, weight.shape[0], bias)


class CpuLinear:
    """x @ weight.T + bias, by row count: up to `half_rows` rows torch's own product on the weight as it is;
    then up to `gemm_rows` rows cpu_gemm (where it takes the weight), in fp32; past that, with `packed_bf16`,
    cpu_gemm_bf16 (where it takes the weight), else oneDNN in `onednn_dtype`. Rounded once to x's dtype. One
    instance serves one model."""

    def __init__(self, half_rows: int, gemm_rows: float, onednn_dtype: torch.dtype = torch.float32,
                 packed_bf16: bool = False) -> None:
        self.half_rows = half_rows
        self.gemm_rows = gemm_rows
        self.onednn = OneDnnProduct(onednn_dtype)
        self.packed_bf16 = PackedBf16Product() if packed_bf16 else None

    def uses_gemm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.half_rows < x.shape[0] <= self.gemm_rows and cpu_gemm.supports(x, weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() <= self.half_rows * weight.shape[1]:
            return F.linear(x, weight, bias)
        if self.uses_gemm(x, weight):
            return cpu_gemm.linear(x, weight, bias)
        if self.packed_bf16 is not None and cpu_gemm_bf16.supports(x, weight):
            return self.packed_bf16(x, weight, bias)
        return self.onednn(x, weight, bias).to(x.dtype)


def widens_matmuls(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of this dtype multiplies in fp32 on this device (a CPU that emulates half precision)."""
    return device.type == "cpu" and dtype != torch.float32 and not cpu_has_fast_bf16()


def cpu_has_fast_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_gemm.cpu_flags())
