import math
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedchat.engine.worker.compiled_decode import CompiledDecode
from pagedchat.engine import models
from pagedchat.engine.layers.plan import plan_for
from pagedchat.engine.loading.gguf import GgufModel
from pagedchat.engine.core.scheduler import ScheduledSeq
from pagedchat.engine.runtime.memory import return_large_buffers
from pagedchat.kernels import AttentionMetadata, kv_quant, torch_ops

if TYPE_CHECKING:  # transformers' model code is imported only where a model of it is loaded
    from transformers import PreTrainedModel


@dataclass(slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> "KVLayout":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """All layers' K and V of one block in a cache of `dtype` (an 8-bit cache's scales included)."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * kv_quant.row_bytes(dtype, self.head_dim)


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take memory as they are written: on a CPU, calloc's pages (through numpy), which the OS maps at
    first touch, so a pool's memory holds the blocks in use, not all it could hold, as with llama.cpp's cache;
    torch.zeros writes every byte at once."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    return torch.from_numpy(np.zeros(count * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    """Runs one packed step of all scheduled tokens through the lean forward, with paged KV."""

    def __init__(self, model: "PreTrainedModel | GgufModel", num_blocks: int, block_size: int, attention_ops: ModuleType,
                 max_model_len: int, compile: bool = False, kv_cache_dtype: torch.dtype | None = None):
        self.model = model
        backend = attention_ops.__name__.rpartition(".")[2].removesuffix("_ops")
        forward = models.forward_for(model.config.model_type)
        self.kv_cache_dtype = kv_cache_dtype or model.dtype
        if isinstance(model, GgufModel):
            formats = tuple(model.weight_types) if model.in_place else ()
            self.plan = plan_for(model.dtype, model.device, backend, formats, self.kv_cache_dtype)
            self.lean = forward.from_gguf(model, max_model_len, self.plan)
        else:
            self.plan = plan_for(model.dtype, model.device, backend, kv_cache_dtype=self.kv_cache_dtype)
            self.lean = forward.from_transformers(model, max_model_len, self.plan)
        self.block_size = block_size
        self.attention_ops = attention_ops
        self.device = model.device
        self.layout = layout = KVLayout.of(model.config)
        return_large_buffers()  # before the pool: each layer's calloc is then a mapping, its pages untouched
        # one block past the pool's: the compiled step's warm-up and padding write and read there
        shape = (num_blocks + 1, block_size, layout.num_kv_heads, kv_quant.row_width(self.kv_cache_dtype, layout.head_dim))
        self.kv_caches = [(untouched_zeros(shape, self.kv_cache_dtype, self.device),
                           untouched_zeros(shape, self.kv_cache_dtype, self.device)) for _ in range(layout.num_layers)]
        self.bytes_per_block = layout.bytes_per_block(block_size, self.kv_cache_dtype)
        self.compiled: CompiledDecode | None = None
        # compiling gains only where the eager step multiplies one row as the compiled one does, by torch's own
        # product; where cpu_gemm or oneDNN takes one row the eager step is the faster (bench/RESULTS.md)
        # (and it traces a cache of the model's own dtype)
        if compile and self.device.type == "cpu" and attention_ops is torch_ops and self.plan.one_row_is_torch_product \
                and self.kv_cache_dtype == model.dtype:
            self.compiled = CompiledDecode(self.lean, self.kv_caches, scratch_block=num_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the scheduled tokens' KV; return logits [num sampling seqs, vocab] in batch order."""
        bs = self.block_size
        if len(batch) == 1 and batch[0].num_tokens == 1 and batch[0].samples and self.compiled is not None:
            if self.compiled.ready():
                return self._decode_compiled(batch[0].seq)
            self.compiled.prepare()
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        metadata = AttentionMetadata.build(
            [item.seq.block_table for item in batch],
            [item.seq.num_computed_tokens + item.num_tokens for item in batch],
            [item.num_tokens for item in batch], slots, self.device,
        )
        return self.lean.forward(self._long(input_ids), self._long(positions), self._long(sample_rows),
                                 self.kv_caches, metadata, self.attention_ops)

    def _decode_compiled(self, seq) -> torch.Tensor:
        position = seq.num_computed_tokens
        num_blocks = position // self.block_size + 1
        slot = seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
        return self.compiled(self._long([seq.token_ids[position]]), self._long([position]), self._long([slot]),
                             self._long([self.compiled.pad_table(seq.block_table[:num_blocks])]),
                             self._long([position + 1]))

    def _long(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
