from pagedchat.engine.core.block_pool import BlockPool, chain_hash
from pagedchat.engine.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of sequences over one BlockPool: prefix reuse, growth, copy-on-write, forks and frees."""

    def __init__(self, pool: BlockPool, enable_prefix_caching: bool):
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) blocks the runner copies before the next forward
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the prefix cache that hold seq's leading full blocks; the last token is always recomputed."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        self._extend_hashes(seq, max_blocks * self.block_size)
        bs = self.block_size
        hits: list[int] = []
        parent = None
        for index, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            parent = self.pool.lookup(block_hash, seq.token_ids[index * bs : (index + 1) * bs], parent)
            if parent is None:
                break
            hits.append(parent.block_id)
        return hits

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> int:
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size
        have = len(seq.block_table) + len(cached)
        grow = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - have)
        revive = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        return grow + revive + self._needs_cow(seq, num_new_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give seq the slots for its next num_new_tokens (after sharing `cached`); False, changing nothing, if the pool is short."""
        if self.blocks_needed(seq, num_new_tokens, cached) > self.pool.num_free:
            return False
        if not seq.block_table and self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += len(cached) * self.block_size
        for block_id in cached:
            self.pool.share(block_id, seq.seq_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens += len(cached) * self.block_size
        if self._needs_cow(seq, num_new_tokens):
            self._copy_on_write(seq)
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self.pool.allocate(seq.seq_id).block_id)
        return True

    def _needs_cow(self, seq: Sequence, num_new_tokens: int) -> bool:
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return (
            num_new_tokens > 0
            and offset > 0
            and index < len(seq.block_table)
            and self.pool.blocks[seq.block_table[index]].ref_count > 1
        )

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        assert index == len(seq.block_table) - 1, "only the last block of a table is ever partial"
        old = seq.block_table[index]
        new = self.pool.allocate(seq.seq_id)
        new.token_ids = list(self.pool.blocks[old].token_ids)
        self.pool.free(old, seq.seq_id)
        seq.block_table[index] = new.block_id
        self.pending_copies.append((old, new.block_id))
        self.pool.record("cow", new.block_id, seq.seq_id)

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that seq's next num_new_tokens are now in the cache; full blocks become findable."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
        bs = self.block_size
        for index in range(start // bs, cdiv(end, bs)):
            block = self.pool.blocks[seq.block_table[index]]
            block.token_ids = seq.token_ids[index * bs : min((index + 1) * bs, end)]
        seq.num_computed_tokens = end
        if self.enable_prefix_caching:
            self._extend_hashes(seq, end)
            for index in range(start // bs, end // bs):  # the blocks this commit filled
                parent = self.pool.blocks[seq.block_table[index - 1]] if index else None
                self.pool.register(self.pool.blocks[seq.block_table[index]], seq.block_hashes[index], parent)

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        for index in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_ids[index * bs : (index + 1) * bs])))

    def fork(self, src: Sequence, dst: Sequence) -> None:
        assert not dst.block_table
        for block_id in src.block_table:
            self.pool.share(block_id, dst.seq_id)
        dst.block_table = list(src.block_table)
        dst.block_hashes = list(src.block_hashes)
        dst.num_computed_tokens = src.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Drop seq's blocks (its tokens stay, to be recomputed or found in the prefix cache later)."""
        # Last blocks first, so that the end of a sequence is evicted before its shareable beginning.
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id, seq.seq_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
