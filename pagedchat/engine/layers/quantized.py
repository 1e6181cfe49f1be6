"""Weights as a GGUF file holds them: a quantized matrix is its rows of blocks where the file lies (mapped), and
the products of sibling matrices (q/k/v, gate/up) write into column slices of one output instead of being fused
by concatenating their weights, which would copy them. A layer whose matrices are all quantized runs, but for
its attention, in two calls (`QuantizedLayer`): a step of a small model spends more in the calls around its
products than in them. A decode step of a model of such layers is three C calls a layer and no other Python
(`QuantizedStack`)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedchat.kernels import AttentionMetadata, cpu_gemm, quant, torch_ops


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A matrix of shape (N, K) held as `data`, uint8 [N, row bytes] of `ggml_type`'s blocks (a view of the
    file's mapping)."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [len(ids), K]: an embedding lookup."""
        return quant.dequantize_rows(self.data, self.ggml_type, self.shape[1], ids)


Matrix = QuantizedWeight | torch.Tensor


@dataclass(frozen=True, slots=True)
class ColumnProduct:
    """x @ [W_0; W_1; ...]^T in fp32 without concatenating the W_i: each product fills its own columns.
    `interleaved_heads`, where given, is the number of heads of `head_dim` rows at the start whose two rotary
    halves a llama.cpp file interleaves (its row 2i + j of a head is transformers' row j * head_dim / 2 + i);
    their columns are read back into transformers' order by one strided copy."""

    parts: tuple[Matrix, ...]
    interleaved_heads: int = 0
    head_dim: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = torch.empty(rows, self.shape[0], dtype=torch.float32)
        interleaved = self.interleaved_heads * self.head_dim
        # the interleaved columns are multiplied into a buffer of their own and copied into place once
        file_order = torch.empty(rows, interleaved, dtype=torch.float32) if interleaved else None
        start = 0
        for part in self.parts:
            end = start + part.shape[0]
            target = file_order[:, start:end] if end <= interleaved else out[:, start:end]
            if isinstance(part, QuantizedWeight):
                quant.linear(x, part.data, part.ggml_type, part.shape[1], out=target)
            else:
                target.copy_(_plain_product(x, part))
            start = end
        if interleaved:
            heads, half = self.interleaved_heads, self.head_dim // 2
            out[:, :interleaved].view(rows, heads, 2, half).copy_(
                file_order.view(rows, heads, half, 2).transpose(-1, -2))
        return out


def _plain_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T of a plain (F32/F16/BF16) matrix of the file, on the weight as it is: cpu_gemm widens it in
    registers; torch, where cpu_gemm is not built, multiplies in the weight's dtype."""
    if cpu_gemm.kernel() is not None and cpu_gemm.supports(x, weight):
        return cpu_gemm.linear(x, weight)
    return F.linear(x.to(weight.dtype), weight)


@dataclass(frozen=True, slots=True)
class QuantizedLayer:
    """A layer's ops before and after its attention, each one call of cpu_quant.c (kernels/quant.py)."""

    attention_inputs: quant.AttentionInputs  # (residual, cos, sin_signed) -> q|k|v rotated, transformers' order
    mlp: quant.Mlp  # (residual, attention) -> the residual leaving the layer, updated in place

    @classmethod
    def of(cls, input_norm: torch.Tensor, qkv: "ColumnProduct", qkv_bias: torch.Tensor | None,
           head_norms: tuple[torch.Tensor, torch.Tensor] | None, o: "ColumnProduct", o_bias: torch.Tensor | None,
           post_norm: torch.Tensor, gate_up: "ColumnProduct", down: "ColumnProduct", eps: float
           ) -> "QuantizedLayer | None":
        """The layer in two calls where every matrix is quantized (as the products take it) and the vectors are
        fp32; else None, and the layer runs product by product."""
        matrices = (*qkv.parts, *o.parts, *gate_up.parts, *down.parts)
        if (len(matrices) != 7 or not all(isinstance(m, QuantizedWeight) for m in matrices)
                or any(v is not None and v.dtype != torch.float32
                       for v in (input_norm, post_norm, qkv_bias, o_bias, *(head_norms or ())))):
            return None
        q, k, v, out, gate, up, down_ = ((m.data, m.ggml_type) for m in matrices)
        interleaved = qkv.interleaved_heads > 0
        return cls(quant.AttentionInputs(input_norm, eps, q, k, v, qkv_bias, qkv.head_dim, interleaved, head_norms),
                   quant.Mlp(out, o_bias, post_norm, eps, gate, up, down_))


@dataclass(frozen=True, slots=True)
class QuantizedStack:
    """A model's layers where every one is a `QuantizedLayer`, run on a step of decodes only (one new token a
    sequence, attended in place by cpu_attention.c) as three C calls a layer: the step's q|k|v, attention and
    row buffers are made and checked once and every layer reuses them, since a small model's decode step spent
    as much in the Python around its calls (tensors made, views taken, checks) as in its products."""

    layers: tuple[QuantizedLayer, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def decode(self, residual: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata, scale: float
               ) -> bool:
        """Runs the layers on `residual` (fp32 [S, hidden], updated in place) and True, where the step is of
        decodes only that cpu_attention.c takes; else False, and nothing was done."""
        rows = residual.shape[0]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if rows > quant.ROWS_PER_CALL:
            return False
        qkv = torch.empty(rows, q_width + 2 * kv_width, dtype=torch.float32)
        q, k, v = (part.view(rows, -1, self.head_dim) for part in qkv.split([q_width, kv_width, kv_width], dim=1))
        out = torch.empty(rows, q_width, dtype=torch.float32)
        attend = torch_ops.decode_step(q, k, v, out.view(rows, -1, self.head_dim), *kv_caches[0], metadata, scale)
        if attend is None:
            return False
        self.layers[0].attention_inputs.check(residual, cos, sin_signed)
        self.layers[0].mlp.check(residual, out)
        x, cos_at, sin_at, qkv_at, out_at = (t.data_ptr() for t in (residual, cos, sin_signed, qkv, out))
        threads = torch.get_num_threads()
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            layer.attention_inputs.run(x, rows, cos_at, sin_at, qkv_at, threads)
            attend(key_cache, value_cache)
            layer.mlp.run(x, out_at, rows, threads)
        return True
