"""One step's batch layout, built once by the model runner and handed to every layer's attention."""

from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends to, for one packed step.

    The tokens of a step are packed sequence after sequence; sequence s owns query rows
    `query_start_loc[s]:query_start_loc[s + 1]`, the last positions of its `seq_lens[s]`-token context.
    The host-side lists are what a backend plans from without reading the device tensors back;
    `plan` holds what a backend derives from them, once per step, for all layers.
    """

    slot_mapping: torch.Tensor  # [T] int64, the cache slot of each new token (block * block_size + offset)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens_host: list[int]
    query_lens_host: list[int]
    block_tables_host: list[list[int]]
    plan: object = field(default=None)

    @classmethod
    def build(cls, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              slot_mapping: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        width = max(map(len, block_tables))
        padded = [table + [0] * (width - len(table)) for table in block_tables]

        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(tensor(slot_mapping, torch.long), tensor(padded), tensor(seq_lens),
                   tensor([0, *accumulate(query_lens)]), list(seq_lens), list(query_lens),
                   [list(t) for t in block_tables])
