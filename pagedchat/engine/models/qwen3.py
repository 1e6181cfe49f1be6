"""Qwen3: Llama's layer with an RMSNorm over each head of q and k before they are rotated."""

import torch

from pagedchat.engine.layers.norm import rms_norm
from pagedchat.engine.layers.ops import LayerOps
from pagedchat.engine.layers.rotary import rotate
from pagedchat.engine.models.llama import LeanLayer, LlamaModel


class Qwen3Model(LlamaModel):
    def attention_inputs(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: LeanLayer,
                         ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if layer.quantized is not None:  # its call norms the heads too
            return super().attention_inputs(residual, cos, sin, layer, ops)
        qkv = ops.norm_matmul(residual, layer.input_norm, self.eps, layer.qkv, layer.qkv_bias)
        q, k, v = self.split_heads(qkv)
        qk = rotate(torch.cat([rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)], dim=1),
                    cos, sin)
        return qk[:, :self.num_heads], qk[:, self.num_heads:], v
