"""The engine's state as immutable values: what the UI draws and what tests check."""

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields


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
    # Computed before the last step ran it (its cached prefix included); num_computed_tokens if it did
    # not run it. The step wrote slots [this, num_computed_tokens) and read every slot below the end.
    num_computed_before_step: int


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
    # after events, with defaults, so that hand-made snapshots and an older server's still build
    kv_cache_dtype: str = ""  # "bfloat16", "float32", "int8", "fp8"; "" where not known
    bytes_per_block: int = 0  # all layers' K and V of one block, an 8-bit cache's scales included; 0: not known
    # what the pool's bytes would hold in the other width: "int8" blocks for a 16/32-bit cache, "bfloat16"
    # blocks for an 8-bit one
    other_kv_cache_dtype: str = ""
    other_num_blocks: int = 0
    weights_format: str = ""  # e.g. "Q4_1 GGUF" (its matrices used where they lie, mapped) or "bf16"
    weights_bytes: int = 0  # the weights in memory; 0: not known


def snapshot_to_json(s: KVSnapshot) -> dict:
    """The snapshot as JSON values, in its own field names; block hashes as strings, since 64-bit ints
    exceed the integers JSON readers hold exactly."""
    data = {f.name: getattr(s, f.name) for f in fields(s)}
    return data | {
        "blocks": [asdict(b) | {"owners": list(b.owners), "token_ids": list(b.token_ids),
                                "block_hash": None if b.block_hash is None else str(b.block_hash)} for b in s.blocks],
        "requests": [asdict(r) | {"block_table": list(r.block_table)} for r in s.requests],
        "block_tables": {key: list(table) for key, table in s.block_tables.items()},
        "events": [asdict(e) for e in s.events],
    }


def snapshot_from_json(d: dict) -> KVSnapshot:
    """The inverse of snapshot_to_json: `snapshot_from_json(snapshot_to_json(s)) == s`."""
    return _build(KVSnapshot, d | {
        "blocks": tuple(_build(BlockInfo, b | {
            "owners": tuple(b["owners"]), "token_ids": tuple(b["token_ids"]),
            "block_hash": None if b["block_hash"] is None else int(b["block_hash"])}) for b in d["blocks"]),
        "requests": tuple(_build(RequestInfo, {
            # an older server leaves the field out: nothing shows as touched by its step
            "num_computed_before_step": r["num_computed_tokens"]} | r | {"block_table": tuple(r["block_table"])})
            for r in d["requests"]),
        "block_tables": {key: tuple(table) for key, table in d["block_tables"].items()},
        "events": tuple(_build(BlockEvent, e) for e in d["events"]),
    })


def _build(cls, d: dict):
    # Fields a newer server adds are left out, so that an older client can still attach to it; fields an older
    # server lacks take their defaults.
    return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d or f.default is MISSING})
