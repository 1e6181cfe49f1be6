"""The kernel plan: which product and which attention a model's layers run, decided once when the model loads
from the device, the CPU's flags, the dtype and the weight format, and consulted by every layer. It says
what it chose in one line (the log, `bench/` and the app print it), and where a C kernel could not be built,
that torch stands in and why."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedchat.engine.layers.linear import CpuLinear, Linear, linear_for
from pagedchat.kernels import cpu_attention, cpu_gemm, kv_quant, native, quant

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_PLAIN_FORMATS = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class KernelPlan:
    dtype: torch.dtype
    device: torch.device
    linear: Linear  # the product: torch's own (F.linear) or CpuLinear's routes by row count
    attention: str  # what attends the decodes: "cpu_attention", "cpu_attention_bf16", "torch" or "triton"
    problems: tuple[str, ...] = ()  # C kernels this CPU could run that could not be built, with the reason
    # a GGUF's matrices multiplied where they lie: their formats (e.g. ('Q4_K', 'Q6_K')), most bytes first;
    # empty for a model of plain `dtype` tensors
    weight_formats: tuple[str, ...] = ()
    kv_cache: str | None = None  # the cache's dtype where it is not the model's, e.g. "int8"

    @property
    def weights_format(self) -> str:
        """The weights as the model holds them: a GGUF's main format where it runs in place ('Q4_1 GGUF'), else
        its dtype ('bf16')."""
        if self.weight_formats:
            return f"{self.weight_formats[0]} GGUF"
        return _DTYPE_NAMES.get(self.dtype, str(self.dtype))

    @property
    def cpu_linear(self) -> CpuLinear | None:
        return self.linear if isinstance(self.linear, CpuLinear) else None

    def fuses(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether cpu_gemm.c takes this product with the ops on either side of it, in one call."""
        return not self.weight_formats and self.cpu_linear is not None and self.cpu_linear.uses_gemm(x, weight)

    def native_ops(self, x: torch.Tensor, depth: int) -> bool:
        """Whether the ops around a product that cpu_gemm does not take (cpu_gemm_bf16's or oneDNN's) are the C
        kernels' alone: one call each, where torch's would be up to ten of fixed cost. Not where torch's own
        product is taken (a few rows without cpu_gemm), which torch's ops go around."""
        if self.weight_formats:
            return cpu_gemm.kernel() is not None and cpu_gemm.takes(x, depth)
        linear = self.cpu_linear
        return (linear is not None and x.shape[0] > linear.half_rows and cpu_gemm.kernel() is not None
                and cpu_gemm.takes(x, depth))

    @property
    def one_row_is_torch_product(self) -> bool:
        """Whether one row is multiplied by torch's own product, as the compiled decode step multiplies it."""
        if self.weight_formats:
            return False
        return self.cpu_linear is None or self.cpu_linear.half_rows >= 1

    def describe(self) -> str:
        """One line, e.g. 'bf16 on avx2: 1+ rows cpu_gemm; decode attention cpu_attention', or for a GGUF's
        weights 'Q4_K/Q6_K on avx2: quant kernels (8-bit activations); decode attention cpu_attention'."""
        if self.weight_formats:
            line = f"{self._quantized_products()}; decode attention {self._attention()}"
            return line + "".join(f"; {problem}" for problem in self.problems)
        isa = ("avx512_bf16" if {"avx512_bf16", "amx_bf16"} & native.cpu_flags() else
               "avx2" if native.AVX2_CPU_FLAGS <= native.cpu_flags() else "no avx2")
        where = isa if self.device.type == "cpu" else self.device.type
        line = f"{_DTYPE_NAMES.get(self.dtype, str(self.dtype))} on {where}: {self._products()}; " \
               f"decode attention {self._attention()}"
        return line + "".join(f"; {problem}" for problem in self.problems)

    def _attention(self) -> str:
        return self.attention if self.kv_cache is None else f"{self.attention} ({self.kv_cache} cache)"

    def _quantized_products(self) -> str:
        quantized = [name for name in self.weight_formats if name not in _PLAIN_FORMATS]
        plain = [name for name in self.weight_formats if name in _PLAIN_FORMATS]
        line = f"{'/'.join(quantized)} on {quant.isa()}: quant kernels (8-bit activations)" if quantized else ""
        if plain:
            route = "cpu_gemm" if cpu_gemm.kernel() is not None else "torch's product"
            line += f"{', ' if line else ''}{'/'.join(plain)} {route}"
        return line

    def _products(self) -> str:
        linear = self.cpu_linear
        if linear is None:
            return "torch's product"
        routes = []
        if linear.half_rows:
            routes.append((linear.half_rows, "torch's product"))
        if linear.gemm_rows > linear.half_rows:
            routes.append((linear.gemm_rows, "cpu_gemm"))
        past = "packed bf16 (cpu_gemm_bf16)" if linear.packed_bf16 else \
            f"oneDNN {_DTYPE_NAMES[linear.onednn.dtype]}"
        if linear.gemm_rows != float("inf"):
            routes.append((float("inf"), past))
        parts, start = [], 1
        for end, name in routes:
            rows = f"{start}+ rows" if end == float("inf") else f"{start} row" if end == start else \
                f"{start}-{int(end)} rows"
            parts.append(f"{rows} {name}")
            start = int(end) + 1 if end != float("inf") else start
        return ", ".join(parts)


def plan_for(dtype: torch.dtype, device: torch.device, attention_backend: str,
             weight_formats: tuple[str, ...] = (), kv_cache_dtype: torch.dtype | None = None) -> KernelPlan:
    """The plan for a model of this dtype on this device, whose attention backend is "torch" or "triton"; with
    `weight_formats`, of a GGUF's matrices multiplied where they lie (`ColumnProduct`), in those formats; over a
    KV cache of `kv_cache_dtype` (None: the model's dtype)."""
    problems = tuple(f"{name} not built ({reason}): torch stands in" for name, isa in _C_FILES
                     if device.type == "cpu" and (reason := native.problem(name, isa)))
    linear = linear_for(dtype, device)
    if attention_backend != "torch":
        attention = attention_backend
    else:
        attention = (cpu_attention.name(dtype, kv_cache_dtype) if device.type == "cpu" else None) or "torch"
    kv_cache = None if kv_cache_dtype in (None, dtype) else kv_quant.NAMES[kv_cache_dtype]
    return KernelPlan(dtype, device, linear, attention, problems, tuple(weight_formats), kv_cache)


_C_FILES = (("cpu_gemm.c", "avx2"), ("cpu_attention.c", "avx2"), ("cpu_gemm_bf16.c", "avx512_bf16"),
            ("cpu_attention_bf16.c", "avx512_bf16"))


def torch_plan(dtype: torch.dtype, device: torch.device) -> KernelPlan:
    """Torch's own product and attention throughout: what the compiled decode step traces."""
    return KernelPlan(dtype, device, F.linear, "torch")

