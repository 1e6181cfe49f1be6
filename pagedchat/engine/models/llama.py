"""pagedchat's own forward for Llama and the families that share its layer (Mistral, Qwen2; Qwen3 in qwen3.py),
on the weights transformers loaded or on a GGUF file's tensors where they lie.

The stock transformers modules spend a CPU step in Python and in small ops (one chat's bf16 decode
step of the default model made 10,073 torch calls); this forward does the same arithmetic in fewer,
larger ops, as vLLM and nano-vllm do: q/k/v and gate/up are one matmul each (the fused weight is one
tensor and transformers' modules keep views of it, so nothing is held twice), rotary comes from a table
computed once by the model's own rotary module (so every rope scaling of fixed frequencies is exact),
q and k are rotated together, and the vocabulary projection runs only on the rows that are sampled.
Norms, rotary and the MLP's activation are transformers' formulas, so greedy fp32 output equals HF
`generate` token for token. On a GGUF's quantized matrices the products are cpu_quant.c's (8-bit activations)
and the model computes in fp32 (loading/gguf.py says why); a layer whose matrices are all quantized runs its
ops before and after the attention in one C call each (layers/quantized.py's QuantizedLayer), and a decode step
of a model of such layers runs as nothing but those calls and the attention's (QuantizedStack).
"""

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedchat.engine.layers.ops import LayerOps
from pagedchat.engine.layers.plan import KernelPlan, torch_plan
from pagedchat.engine.layers.quantized import ColumnProduct, QuantizedLayer, QuantizedStack, QuantizedWeight
from pagedchat.engine.loading import gguf
from pagedchat.engine.loading.gguf import GgufModel
from pagedchat.kernels import AttentionMetadata, torch_ops

Weight = torch.Tensor | ColumnProduct


@dataclass(slots=True)
class LeanLayer:
    input_norm: torch.Tensor
    qkv: Weight  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head before rotary (qwen3.py)
    k_norm: torch.Tensor | None
    o_proj: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    quantized: QuantizedLayer | None = None  # all but the attention in two C calls, where every matrix is quantized


class LlamaModel:
    """Runs a causal LM on one packed step with paged KV; see the module's docstring. Built from a loaded
    transformers model (`from_transformers`) or from a GGUF file's tensors (`from_gguf`); the model's config
    was checked by `models.config_problem` before it loaded."""

    def __init__(self, config, embed: Weight, final_norm: torch.Tensor, lm_head: Weight, layers: list[LeanLayer],
                 rotary: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, plan: KernelPlan):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        self.embed = embed
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.layers = layers
        quantized = tuple(layer.quantized for layer in layers)
        self.stack = (QuantizedStack(quantized, self.num_heads, self.num_kv_heads, self.head_dim)
                      if layers and None not in quantized else None)
        self.ops = LayerOps(plan)
        self.torch_ops = LayerOps(torch_plan(plan.dtype, plan.device))
        cos, sin = rotary  # [P, D]
        half = self.head_dim // 2
        self.cos = cos
        # for layers.rotary.rotate
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    @classmethod
    def from_transformers(cls, model: nn.Module, max_positions: int, plan: KernelPlan) -> "LlamaModel":
        base = model.model
        embed = base.embed_tokens.weight
        positions = torch.arange(max_positions, device=embed.device)[None]
        cos, sin = base.rotary_emb(embed[:1], positions)  # [1, P, D] in the model's dtype
        return cls(model.config, embed, base.norm.weight, model.lm_head.weight,
                   [_fuse_layer(layer) for layer in base.layers], (cos[0], sin[0]), embed.dtype, plan)

    @classmethod
    def from_gguf(cls, model: GgufModel, max_positions: int, plan: KernelPlan) -> "LlamaModel":
        """On a GGUF's tensors as `loading.gguf.open_model` holds them: in place, sibling products write into
        columns of one output (`ColumnProduct`); else plain tensors, fused as a transformers model's are.
        llama.cpp's order of q/k rows (`gguf.PERMUTED_QK`) is read back from the product's output."""
        config, tensors = model.config, model.tensors
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        order = interleaved = None
        if model.permuted_qk:
            interleaved = heads + kv_heads
            order = torch.cat([gguf.qk_order(interleaved, head_dim),
                               torch.arange(interleaved * head_dim, (heads + 2 * kv_heads) * head_dim)])

        def matrix(*names: str, interleaved: int | None = None) -> Weight:
            parts = tuple(tensors[name] for name in names)
            if model.in_place:
                return ColumnProduct(parts, interleaved or 0, head_dim)
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        def vector(*names: str, columns: torch.Tensor | None = None) -> torch.Tensor | None:
            if any(name not in tensors for name in names):
                return None
            joined = torch.cat([tensors[name] for name in names])
            return joined if columns is None else joined[columns]

        layers = []
        for i in range(config.num_hidden_layers):
            b = f"blk.{i}."
            qkv = [b + "attn_q.", b + "attn_k.", b + "attn_v."]
            layer = LeanLayer(
                tensors[b + "attn_norm.weight"], matrix(*(n + "weight" for n in qkv), interleaved=interleaved),
                vector(*(n + "bias" for n in qkv), columns=order),
                tensors.get(b + "attn_q_norm.weight"), tensors.get(b + "attn_k_norm.weight"),
                matrix(b + "attn_output.weight"), vector(b + "attn_output.bias"), tensors[b + "ffn_norm.weight"],
                matrix(b + "ffn_gate.weight", b + "ffn_up.weight"), None, matrix(b + "ffn_down.weight"), None,
            )
            if model.in_place and model.dtype == torch.float32:
                head_norms = None if layer.q_norm is None else (layer.q_norm, layer.k_norm)
                layer.quantized = QuantizedLayer.of(layer.input_norm, layer.qkv, layer.qkv_bias, head_norms,
                                                    layer.o_proj, layer.o_bias, layer.post_norm, layer.gate_up,
                                                    layer.down, config.rms_norm_eps)
            layers.append(layer)
        embed = tensors["token_embd.weight"]
        lm_head = matrix("output.weight" if "output.weight" in tensors else "token_embd.weight")
        return cls(config, embed, tensors["output_norm.weight"], lm_head, layers,
                   _rotary_tables(config, max_positions, model, tensors.get("rope_freqs.weight")), model.dtype, plan)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
                attention_ops: ModuleType) -> torch.Tensor:
        """Logits [len(sample_rows), vocab] for the packed tokens, writing their K/V into the caches."""
        cos, sin = self.cos[positions], self.sin_signed[positions]
        residual = self.embedding(input_ids)
        if not (self.stack is not None and attention_ops is torch_ops
                and self.stack.decode(residual, cos, sin, kv_caches, metadata, self.scale)):
            for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
                q, k, v = self.attention_inputs(residual, cos, sin, layer, self.ops)
                o = attention_ops.attention(q, k, v, key_cache, value_cache, metadata, self.scale)
                residual = self.mlp(o, residual, layer, self.ops)
        return self.logits(residual.index_select(0, sample_rows), self.ops)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits [S, vocab] of a decode batch (one new token per sequence), in plain tensor ops throughout,
        which `torch.compile` takes whole (compiled_decode.py); block_tables [S, NB] padded with any block.
        Its matmuls are torch's own, which inductor sees through."""
        cos, sin = self.cos[positions], self.sin_signed[positions]
        residual = F.embedding(input_ids, self.embed)
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            q, k, v = self.attention_inputs(residual, cos, sin, layer, self.torch_ops)
            o = torch_ops.decode_attention(q, k, v, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
                                           self.scale)
            residual = self.mlp(o, residual, layer, self.torch_ops)
        return self.logits(residual, self.torch_ops)

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.rows(input_ids)
        return F.embedding(input_ids, self.embed).to(self.dtype)  # a GGUF's F16 table in an fp32 model

    def logits(self, residual: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.norm_matmul(residual, self.final_norm, self.eps, self.lm_head, None)

    def attention_inputs(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: LeanLayer,
                         ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated, v [T, Hkv, D], from the residual stream entering a layer."""
        if layer.quantized is not None:
            return self.split_heads(layer.quantized.attention_inputs(residual, cos, sin))
        qkv = ops.norm_matmul(residual, layer.input_norm, self.eps, layer.qkv, layer.qkv_bias,
                              (cos, sin, self.num_heads + self.num_kv_heads))
        return self.split_heads(qkv)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, heads, dim = qkv.shape[0], self.num_heads, self.head_dim
        qk_heads = heads + self.num_kv_heads
        qk = qkv[:, : qk_heads * dim].view(num_tokens, qk_heads, dim)
        v = qkv[:, qk_heads * dim:].view(num_tokens, self.num_kv_heads, dim)
        return qk[:, :heads], qk[:, heads:], v

    def mlp(self, attention_out: torch.Tensor, residual: torch.Tensor, layer: LeanLayer, ops: LayerOps
            ) -> torch.Tensor:
        """The residual stream leaving a layer: + o_proj(attention), then + the MLP of its norm."""
        if layer.quantized is not None:
            return layer.quantized.mlp(residual, attention_out.flatten(1))
        residual = ops.matmul(attention_out.flatten(1), layer.o_proj, layer.o_bias, residual)
        gate_up = ops.norm_matmul(residual, layer.post_norm, self.eps, layer.gate_up, layer.gate_up_bias)
        return ops.silu_matmul(gate_up, layer.down, layer.down_bias, residual)


def _fuse_layer(layer: nn.Module) -> LeanLayer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return LeanLayer(
        layer.input_layernorm.weight, qkv, qkv_bias,
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
        attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
        gate_up, gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias,
    )


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for sibling linears; each linear keeps a view of its rows, so no copy stays."""
    weight = torch.cat([m.weight for m in linears])
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _rotary_tables(config, max_positions: int, model: GgufModel, freq_factors: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [P, D] as the family's transformers rotary module computes them (its default frequencies, or
    those of the config's rope type by transformers' own ROPE_INIT_FUNCTIONS), from the config alone: the
    family's modeling module itself would bring all of transformers' model code (~170 MB) into a process that
    runs a GGUF. A llama.cpp file of Llama 3 carries its rope scaling as a tensor of factors that divide the
    frequencies (`rope_freqs`), as llama.cpp applies them, rather than in its metadata."""
    parameters = config.rope_parameters
    if parameters["rope_type"] == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers import PretrainedConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # the config's fields (`gguf.read_config`) in the class those functions read
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](PretrainedConfig.from_dict(vars(config)))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return ((angles.cos() * scaling).to(model.dtype).to(model.device),
            (angles.sin() * scaling).to(model.dtype).to(model.device))
