"""The engine's state as immutable values: what the UI draws and what tests check."""

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockInfo:
    block_id: int
    ref_count: int
    num_tokens: int
    owners: tuple[str, ...]
    cached: bool
    block_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str  # the API id
    seq_id: str  # the sample: equals request_id when n == 1
    status: str  # "waiting" | "running" | "preempted" | "parked" | "finished"
    block_table: tuple[int, ...]
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    max_len: int


@dataclass(frozen=True, slots=True)
class BlockEvent:
    seq: int
    step: int
    kind: str  # "allocate" | "free" | "evict" | "share" | "cow" | "preempt" | "release"
    block_id: int | None
    request_id: str | None


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    step: int
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_cached_blocks: int
    blocks: tuple[BlockInfo, ...]
    requests: tuple[RequestInfo, ...]
    block_tables: Mapping[str, tuple[int, ...]]
    num_running: int
    num_waiting: int
    num_parked: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    tokens_per_second: float
    events: tuple[BlockEvent, ...]
