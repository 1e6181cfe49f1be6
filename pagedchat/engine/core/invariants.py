"""DESIGN.md's block-pool invariants on a KVSnapshot: checked after every step by the tests and the soak
benchmark, so they live here, importable by both."""

from collections import Counter

from pagedchat.engine.api.snapshot import KVSnapshot


def assert_invariants(snap: KVSnapshot) -> None:
    """DESIGN.md's invariants: used + free = total; a block's ref count = the block tables that hold it."""
    assert len(snap.blocks) == snap.num_blocks
    used = sum(1 for b in snap.blocks if b.ref_count > 0)
    assert used + snap.num_free_blocks == snap.num_blocks
    holders = Counter(block_id for table in snap.block_tables.values() for block_id in table)
    for block in snap.blocks:
        assert block.ref_count == holders[block.block_id], (block, holders[block.block_id])
        assert len(block.owners) == block.ref_count
        assert block.num_tokens <= snap.block_size
        assert not block.cached or block.ref_count == 0
    assert snap.num_cached_blocks == sum(1 for b in snap.blocks if b.cached)


def assert_all_free(snap: KVSnapshot) -> None:
    assert_invariants(snap)
    assert all(b.ref_count == 0 for b in snap.blocks)
    assert snap.num_free_blocks == snap.num_blocks
