"""Products with GGUF-quantized weights where they lie (kernels/cpu_quant.c): x [M, K] @ W [N, K]^T with W a
tensor of the file as raw bytes, [N, row_bytes] uint8 (a memory map's rows), and x quantized per row to 8
bits on the way, as llama.cpp does; and the fp32 rows of such a tensor (a quantized embedding's lookup).

The C file is built once per instruction set of `native.ISAS` that the CPU has; `linear` takes the best one
unless told, so that the tests can run each of them."""

import functools

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedchat.kernels import native

SOURCE = "cpu_quant.c"
# the keys of native.ISAS that build cpu_quant.c, best first (the VNNI ones differ in vpdpbusd alone)
PREFERENCE = ("avx512_vnni", "avx_vnni", "avx2", "portable")
TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                   GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})
# (values, bytes) of a block of each type, by plain int: the checks run on every product of a decode step
_BLOCKS = {int(t): GGML_QUANT_SIZES[t] for t in TYPES}


def supported(ggml_type: int) -> bool:
    return ggml_type in TYPES


def available_isas() -> list[str]:
    """Every instruction set this CPU runs the kernels in (and the compiler built them for), best first."""
    return [name for name in PREFERENCE if _kernel("pagedchat_quant_linear", name) is not None]


@functools.cache
def isa() -> str | None:
    """The instruction set `linear` uses by default here; None where the kernels could not be built."""
    return next(iter(available_isas()), None)


def row_bytes(ggml_type: int, depth: int) -> int:
    """The bytes of one row of `depth` values of this type."""
    block, size = _block(ggml_type)
    if depth % block:
        raise ValueError(f"a row of {GGMLQuantizationType(ggml_type).name} holds a multiple of {block} values, "
                         f"not {depth}")
    return depth // block * size


def linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, depth: int, out: torch.Tensor | None = None,
           isa: str | None = None) -> torch.Tensor:
    """x [M, depth] (fp32, bf16 or fp16) @ W^T in fp32 [M, N], W the N rows of `weight` (uint8 [N, row_bytes],
    contiguous) holding `ggml_type`'s blocks; into `out` where given (fp32 [M, N], its rows any distance
    apart, e.g. columns of a wider buffer). The kernels of `isa` (one of `available_isas()`), by default the
    best."""
    _check_weight(weight, ggml_type, depth)
    kind = native.KINDS.get(x.dtype)
    if kind is None or x.dim() != 2 or x.shape[1] != depth or not x.is_cpu:
        raise ValueError(f"x must be a CPU tensor [M, {depth}] of fp32, bf16 or fp16, not {x.dtype} {tuple(x.shape)}")
    rows, width = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(rows, width, dtype=torch.float32)
    elif (out.dtype != torch.float32 or out.shape != (rows, width) or (width > 1 and out.stride(1) != 1)
          or not out.is_cpu):
        raise ValueError(f"out must be a CPU fp32 [{rows}, {width}] with contiguous rows, not {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if rows and width:
        x = x.contiguous()
        _kernel("pagedchat_quant_linear", _isa(isa))(
            x.data_ptr(), kind, rows, depth, weight.data_ptr(), ggml_type, width, out.data_ptr(), out.stride(0),
            torch.get_num_threads())
    return out


def dequantize_rows(weight: torch.Tensor, ggml_type: int, depth: int, rows: torch.Tensor) -> torch.Tensor:
    """fp32 [len(rows), depth]: rows `rows` (integers) of W, as gguf's dequantizer gives them."""
    _check_weight(weight, ggml_type, depth)
    ids = rows.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < weight.shape[0]):
        raise IndexError(f"row ids out of range for {weight.shape[0]} rows")
    out = torch.empty(ids.numel(), depth, dtype=torch.float32)
    if ids.numel():
        _kernel("pagedchat_quant_dequantize_rows", _isa(None))(
            weight.data_ptr(), ggml_type, depth, ids.data_ptr(), ids.numel(), out.data_ptr(), torch.get_num_threads())
    return out


@functools.cache
def _kernel(symbol: str, isa: str) -> native.Kernel | None:
    return native.function(SOURCE, symbol, isa=isa)


def _isa(name: str | None) -> str:
    if name is None:
        name = isa()
        if name is None:
            raise RuntimeError(f"{SOURCE} could not be built (see the log)")
    elif name not in available_isas():
        raise ValueError(f"instruction set {name!r} is not available here (available: {available_isas()})")
    return name


def _block(ggml_type: int) -> tuple[int, int]:
    layout = _BLOCKS.get(ggml_type)
    if layout is None:
        raise ValueError(f"no kernels for GGML type {ggml_type}; these take "
                         f"{sorted(GGMLQuantizationType(t).name for t in TYPES)}")
    return layout


def _check_weight(weight: torch.Tensor, ggml_type: int, depth: int) -> None:
    expected = row_bytes(ggml_type, depth)
    if (weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != expected
            or not weight.is_contiguous() or not weight.is_cpu):
        raise ValueError(f"weight must be a contiguous CPU uint8 tensor [N, {expected}], not {weight.dtype} "
                         f"{tuple(weight.shape)}")
