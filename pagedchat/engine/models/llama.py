"""pagedchat's own forward for Llama and the families that share its layer (Mistral, Qwen2; Qwen3 in qwen3.py),
on the weights transformers loaded.

The stock transformers modules spend a CPU step in Python and in small ops (one chat's bf16 decode
step of the default model made 10,073 torch calls); this forward does the same arithmetic in fewer,
larger ops, as vLLM and nano-vllm do: q/k/v and gate/up are one matmul each (the fused weight is one
tensor and transformers' modules keep views of it, so nothing is held twice), rotary comes from a table
computed once by the model's own rotary module (so every rope scaling of fixed frequencies is exact),
q and k are rotated together, and the vocabulary projection runs only on the rows that are sampled.
Norms, rotary and the MLP's activation are transformers' formulas, so greedy fp32 output equals HF
`generate` token for token.
"""

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedchat.engine.layers.ops import LayerOps
from pagedchat.engine.layers.plan import KernelPlan, torch_plan
from pagedchat.kernels import AttentionMetadata, torch_ops



@dataclass(slots=True)
class LeanLayer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head before rotary (qwen3.py)
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class LlamaModel:
    """Runs a loaded transformers causal LM on one packed step with paged KV; see the module's docstring. The
    model's config was checked by `models.check_config` before it loaded."""

    def __init__(self, model: nn.Module, max_positions: int, plan: KernelPlan):
        config = model.config
        base = model.model
        attn = base.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.eps = config.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [_fuse_layer(layer) for layer in base.layers]
        self.ops = LayerOps(plan)
        self.torch_ops = LayerOps(torch_plan(plan.dtype, plan.device))
        positions = torch.arange(max_positions, device=self.embed.device)[None]
        cos, sin = base.rotary_emb(self.embed[:1], positions)  # [1, P, D] in the model's dtype
        half = self.head_dim // 2
        self.cos = cos[0]
        # for layers.rotary.rotate
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
                attention_ops: ModuleType) -> torch.Tensor:
        """Logits [len(sample_rows), vocab] for the packed tokens, writing their K/V into the caches."""
        cos, sin = self.cos[positions], self.sin_signed[positions]
        residual = F.embedding(input_ids, self.embed)
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

    def logits(self, residual: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.norm_matmul(residual, self.final_norm, self.eps, self.lm_head, None)

    def attention_inputs(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: LeanLayer,
                         ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated, v [T, Hkv, D], from the residual stream entering a layer."""
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
