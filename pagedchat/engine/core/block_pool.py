import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pagedchat.engine.api.snapshot import BlockEvent

MAX_EVENTS = 400


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """The prefix cache's index key. Ints and tuples of ints hash the same in every process (None does
    not before Python 3.12); a first block hashes a shorter tuple, so no parent hash can stand for it.
    Keys may collide: a hit is confirmed on the block's tokens and parent (BlockPool.lookup)."""
    return hash((token_ids,) if parent is None else (parent, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    fill: int = 0  # numbers each allocation, so that a child can name the very content it followed
    parent_fill: int | None = None  # the fill of the block before it in the chain it was cached from


class BlockPool:
    """Physical KV blocks: ref counts, a free queue in eviction order, and the prefix-cache index.

    A free block keeps its hash (and stays findable) until it is taken for new data: eviction is lazy.
    The free queue is an OrderedDict: O(1) to take from the head and to remove from the middle.
    """

    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, list[int]] = {}  # block hash -> the cached blocks under that key
        self._fills = itertools.count(1)
        self.events: deque[BlockEvent] = deque(maxlen=MAX_EVENTS)
        self.event_seq = 0
        self.step = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def record(self, kind: str, block_id: int | None, request_id: str | None) -> None:
        self.events.append(BlockEvent(self.event_seq, self.step, kind, block_id, request_id))
        self.event_seq += 1

    def allocate(self, request_id: str) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.block_hash is not None:
            self._uncache(block)
            self.record("evict", block_id, None)
        block.token_ids = []
        block.fill = next(self._fills)
        block.ref_count = 1
        self.record("allocate", block_id, request_id)
        return block

    def share(self, block_id: int, request_id: str) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1
        self.record("share", block_id, request_id)

    def free(self, block_id: int, request_id: str) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        self.free_queue[block_id] = None
        if block.block_hash is None:
            # Holds nothing reusable: hand it out before any cached block.
            self.free_queue.move_to_end(block_id, last=False)
        self.record("free", block_id, request_id)

    def lookup(self, block_hash: int, token_ids: list[int], parent: Block | None) -> Block | None:
        """The cached block that holds token_ids right after `parent` (None: at the start), if any."""
        parent_fill = None if parent is None else parent.fill
        for block_id in self.cached.get(block_hash, ()):
            block = self.blocks[block_id]
            if block.parent_fill == parent_fill and block.token_ids == token_ids:
                return block
        return None

    def register(self, block: Block, block_hash: int, parent: Block | None) -> None:
        """Make a full block findable after `parent`, which must be findable itself; the first block
        with a given content wins."""
        if block.block_hash is not None or (parent is not None and parent.block_hash is None):
            return
        if self.lookup(block_hash, block.token_ids, parent) is None:
            block.block_hash = block_hash
            block.parent_fill = None if parent is None else parent.fill
            self.cached.setdefault(block_hash, []).append(block.block_id)

    def _uncache(self, block: Block) -> None:
        bucket = self.cached[block.block_hash]
        bucket.remove(block.block_id)
        if not bucket:
            del self.cached[block.block_hash]
        block.block_hash = block.parent_fill = None

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self.free_queue if self.blocks[b].block_hash is not None)
