"""The block pool and KV manager driven by random operation sequences (no model): invariants after each."""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.core.block_pool import BlockPool
from pagedchat.engine.core.kv_manager import KVCacheManager
from pagedchat.engine.core.sequence import Sequence

BLOCK_SIZE = 4
NUM_BLOCKS = 24


def check(pool: BlockPool, seqs: list[Sequence]) -> None:
    holders = Counter(block_id for seq in seqs for block_id in seq.block_table)
    for block in pool.blocks:
        assert block.ref_count == holders[block.block_id]
        assert (block.block_id in pool.free_queue) == (block.ref_count == 0)
        if block.block_hash is not None:
            assert block.block_id in pool.cached[block.block_hash]
            assert len(block.token_ids) == BLOCK_SIZE
    assert sum(b.ref_count > 0 for b in pool.blocks) + pool.num_free == NUM_BLOCKS
    assert sum(map(len, pool.cached.values())) == sum(b.block_hash is not None for b in pool.blocks)
    for seq in seqs:
        assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
        for index, block_id in enumerate(seq.block_table):
            held = pool.blocks[block_id].token_ids
            expected = seq.token_ids[index * BLOCK_SIZE : min((index + 1) * BLOCK_SIZE, seq.num_computed_tokens)]
            assert held[: len(expected)] == expected, "a block lost the tokens of a sequence that holds it"


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "cow"]), st.integers(0, 10**6)),
               min_size=1, max_size=80)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_operations_keep_the_invariants(ops):
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    kv = KVCacheManager(pool, enable_prefix_caching=True)
    seqs: list[Sequence] = []
    params = SamplingParams()
    for op, arg in ops:
        rng = random.Random(arg)
        if op == "add" or not seqs:
            # Few distinct tokens, so prefixes repeat and the cache gets hits.
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            seq = Sequence(f"s{arg}-{len(seqs)}", "r", 0, tokens, params, 1000)
            cached = kv.cached_prefix(seq)
            todo = len(seq) - len(cached) * BLOCK_SIZE
            if kv.allocate(seq, todo, cached):
                kv.commit(seq, todo)
                seqs.append(seq)
        elif op in ("append", "cow"):
            seq = seqs[arg % len(seqs)]
            if op == "cow":  # make its last block shared, then write into it
                twin = Sequence(f"{seq.seq_id}+", "r", 0, list(seq.token_ids), params, 1000)
                kv.fork(seq, twin)
                seqs.append(twin)
            new = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            seq.token_ids += new
            if kv.allocate(seq, len(new)):
                kv.commit(seq, len(new))
            else:
                del seq.token_ids[-len(new):]
        elif op == "fork":
            src = seqs[arg % len(seqs)]
            dst = Sequence(f"{src.seq_id}/{arg}", "r", 0, list(src.token_ids), params, 1000)
            kv.fork(src, dst)
            seqs.append(dst)
        elif op == "free":
            seq = seqs.pop(arg % len(seqs))
            kv.free(seq)
        if kv.pending_copies:  # stand in for the runner's KV copy: contents travel with the copy
            kv.pending_copies.clear()
        check(pool, seqs)
    for seq in seqs:
        kv.free(seq)
    check(pool, [])
    assert pool.num_free == NUM_BLOCKS


def test_free_queue_hands_out_uncached_blocks_first_and_evicts_a_prefix_from_its_tail():
    pool = BlockPool(4, 2)
    kv = KVCacheManager(pool, enable_prefix_caching=True)
    seq = Sequence("a", "a", 0, [1, 2, 3, 4, 5], SamplingParams(), 100)
    assert kv.allocate(seq, 5)
    kv.commit(seq, 5)
    first, second, partial = seq.block_table
    kv.free(seq)
    assert pool.num_cached_free == 2
    taken = [pool.allocate("b").block_id for _ in range(4)]
    unused = ({0, 1, 2, 3} - {first, second, partial}).pop()
    assert taken == [partial, unused, second, first]
    assert [e.block_id for e in pool.events if e.kind == "evict"] == [second, first]
