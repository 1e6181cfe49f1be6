from dataclasses import dataclass
from types import ModuleType

import torch
from transformers import AttentionInterface, PreTrainedModel

from pagedchat.engine.scheduler import ScheduledSeq

ATTENTION_NAME = "pagedchat"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D], rotary applied
    key: torch.Tensor,  # [1, KVH, T, D], not repeated for GQA
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    *,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    attention_ops: ModuleType,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    key_cache, value_cache = kv_caches[module.layer_idx]
    attention_ops.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache, slot_mapping)
    out = attention_ops.paged_attention(
        query[0].transpose(0, 1), key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scaling if scaling is not None else module.head_dim**-0.5,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


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
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize


class ModelRunner:
    """Runs a stock transformers model on one packed sequence of all scheduled tokens, with paged KV."""

    def __init__(self, model: PreTrainedModel, num_blocks: int, block_size: int, attention_ops: ModuleType):
        self.model = model
        self.block_size = block_size
        self.attention_ops = attention_ops
        self.device = model.device
        layout = KVLayout.of(model.config)
        shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=self.device), torch.zeros(shape, dtype=model.dtype, device=self.device))
            for _ in range(layout.num_layers)
        ]
        model.set_attn_implementation(ATTENTION_NAME)

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
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        max_blocks = max(len(item.seq.block_table) for item in batch)
        tables = [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table)) for item in batch]

        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        out = self.model(
            input_ids=tensor(input_ids, torch.long).unsqueeze(0),
            position_ids=tensor(positions, torch.long).unsqueeze(0),
            use_cache=False,
            logits_to_keep=tensor(sample_rows, torch.long),
            kv_caches=self.kv_caches,
            attention_ops=self.attention_ops,
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor(tables),
            seq_lens=tensor(seq_lens),
            query_start_loc=tensor(query_start_loc),
        )
        return out.logits[0]
