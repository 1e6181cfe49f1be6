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


Matrix = tuple[torch.Tensor, int]  # (uint8 [N, row_bytes] of a GGUF tensor, its ggml_type)

# A prefill's rows go to a layer's calls this many at a time: a call's scratch grows with its rows (x quantized,
# the MLP's gate, up and hidden rows: ~200 KB a row on an 8B's MLP), and past a few hundred rows reading the
# weights once more costs nothing beside their products.
ROWS_PER_CALL = 256


class AttentionInputs:
    """A layer's q, k and v from the residual stream entering it, in one call: rms_norm, the three products, the
    bias, the norm of each head of q and k where given (Qwen3) and their rotary (`pagedchat_quant_qkv`). Its
    weights are checked once, here; `interleaved`: q and k are a llama.cpp file's, each head's rotary halves
    interleaved, and come out in transformers' order (as the bias and the norms must be given)."""

    def __init__(self, norm_weight: torch.Tensor, eps: float, q: Matrix, k: Matrix, v: Matrix,
                 bias: torch.Tensor | None, head_dim: int, interleaved: bool,
                 head_norms: tuple[torch.Tensor, torch.Tensor] | None = None, isa: str | None = None):
        if head_dim % 2 or not 0 < head_dim <= 512:
            raise ValueError(f"head_dim must be even and at most 512, not {head_dim}")
        self.depth = norm_weight.numel()
        for weight, ggml_type in (q, k, v):
            _check_weight(weight, ggml_type, self.depth)
        self.width = q[0].shape[0] + k[0].shape[0] + v[0].shape[0]
        _check_vector(norm_weight, self.depth)
        if bias is not None:
            _check_vector(bias, self.width)
        for norm in head_norms or ():
            _check_vector(norm, head_dim)
        self.keep = (norm_weight, q, k, v, bias, head_norms)  # the tensors whose pointers the call takes
        self.head_dim = head_dim
        self.fn = _kernel("pagedchat_quant_qkv", _isa(isa))
        self.args = (norm_weight.data_ptr(), eps, q[0].data_ptr(), q[1], q[0].shape[0], k[0].data_ptr(), k[1],
                     k[0].shape[0], v[0].data_ptr(), v[1], v[0].shape[0], native.pointer(bias),
                     *(native.pointer(norm) for norm in head_norms or (None, None)))
        self.interleaved = int(interleaved)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """fp32 [M, width] from x fp32 [M, depth] and each row's rotary tables, fp32 [M, head_dim]."""
        rows = x.shape[0]
        self.check(x, cos, sin_signed)
        y = torch.empty(rows, self.width, dtype=torch.float32)
        threads = torch.get_num_threads()
        for start in range(0, rows, ROWS_PER_CALL):
            self.run(x[start].data_ptr(), min(ROWS_PER_CALL, rows - start), cos[start].data_ptr(),
                     sin_signed[start].data_ptr(), y[start].data_ptr(), threads)
        return y

    def check(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        rows = x.shape[0]
        _check_rows(x, rows, self.depth)
        _check_rows(cos, rows, self.head_dim)
        _check_rows(sin_signed, rows, self.head_dim)

    def run(self, x: int, rows: int, cos: int, sin_signed: int, y: int, threads: int) -> None:
        """The call itself, on the addresses of rows that `check` passed (at most ROWS_PER_CALL) and of y, fp32
        [rows, width]: for a caller that calls it layer after layer on the same buffers."""
        self.fn(x, rows, self.depth, *self.args, cos, sin_signed, self.head_dim, self.interleaved, y, threads)


class Mlp:
    """The rest of a layer after its attention, in one call (`pagedchat_quant_mlp`): residual += o_proj(attention)
    + o_bias, then residual += down(silu(gate(h)) * up(h)) with h = rms_norm(residual). Checked once, here."""

    def __init__(self, o: Matrix, o_bias: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 gate: Matrix, up: Matrix, down: Matrix, isa: str | None = None):
        self.hidden, self.inner = norm_weight.numel(), gate[0].shape[0]
        self.attention_width = _depth(o)
        _check_weight(o[0], o[1], self.attention_width)
        for weight, ggml_type in (gate, up):
            _check_weight(weight, ggml_type, self.hidden)
        _check_weight(down[0], down[1], self.inner)
        if o[0].shape[0] != self.hidden or up[0].shape[0] != self.inner or down[0].shape[0] != self.hidden:
            raise ValueError(f"the MLP's shapes do not chain: o {tuple(o[0].shape)}, gate {tuple(gate[0].shape)}, "
                             f"up {tuple(up[0].shape)}, down {tuple(down[0].shape)} for hidden {self.hidden}")
        _check_vector(norm_weight, self.hidden)
        if o_bias is not None:
            _check_vector(o_bias, self.hidden)
        self.keep = (o, o_bias, norm_weight, gate, up, down)
        self.fn = _kernel("pagedchat_quant_mlp", _isa(isa))
        self.args = (o[0].data_ptr(), o[1], native.pointer(o_bias), norm_weight.data_ptr(), eps, gate[0].data_ptr(),
                     gate[1], up[0].data_ptr(), up[1], self.inner, down[0].data_ptr(), down[1])

    def __call__(self, residual: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """`residual` (fp32 [M, hidden], contiguous) updated in place and returned; attention fp32 [M, width]."""
        rows = residual.shape[0]
        self.check(residual, attention)
        threads = torch.get_num_threads()
        for start in range(0, rows, ROWS_PER_CALL):
            self.run(residual[start].data_ptr(), attention[start].data_ptr(), min(ROWS_PER_CALL, rows - start),
                     threads)
        return residual

    def check(self, residual: torch.Tensor, attention: torch.Tensor) -> None:
        _check_rows(residual, residual.shape[0], self.hidden)
        _check_rows(attention, residual.shape[0], self.attention_width)

    def run(self, residual: int, attention: int, rows: int, threads: int) -> None:
        """The call itself, on the addresses of rows that `check` passed (at most ROWS_PER_CALL)."""
        self.fn(residual, attention, rows, self.hidden, self.attention_width, *self.args, threads)


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


def _depth(matrix: Matrix) -> int:
    """The values in a row of `matrix`, from its row bytes."""
    weight, ggml_type = matrix
    block, size = _block(ggml_type)
    return weight.shape[-1] // size * block


def _check_vector(vector: torch.Tensor, length: int) -> None:
    if vector.dtype != torch.float32 or vector.shape != (length,) or not vector.is_contiguous() or not vector.is_cpu:
        raise ValueError(f"expected a contiguous CPU fp32 vector of {length}, not {vector.dtype} {tuple(vector.shape)}")


def _check_rows(x: torch.Tensor, rows: int, width: int) -> None:
    """A call's per-step tensors: these are read as fp32 [rows, width], contiguous."""
    if x.dtype != torch.float32 or x.shape != (rows, width) or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"expected a contiguous CPU fp32 [{rows}, {width}], not {x.dtype} {tuple(x.shape)}"
                         f"{'' if x.is_contiguous() else ' (not contiguous)'}")
