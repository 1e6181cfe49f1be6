"""One rank's prefix cache as vLLM's KV events describe it: the resident full blocks, each under its parent.

vLLM hashes a block together with its parent's hash, so a hash names a block's whole prefix: a tab's
cached prefix is found by walking its token blocks down from the roots. A block whose parent is not
resident (stored before a partial attach, or the parent was evicted first) is the root of a subtree of
its own, an orphan: drawn, but never matched, since vLLM itself only matches prefixes from the first
block. Every event costs O(1) per block.
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedchat.attach.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Hash

EVICTIONS_KEPT = 256


@dataclass(frozen=True, slots=True)
class Node:
    hash: Hash
    parent: Hash | None
    token_ids: tuple[int, ...]
    stored_seq: int


@dataclass(frozen=True, slots=True)
class Eviction:
    seq: int
    hash: Hash
    tokens: int


class PrefixTree:
    def __init__(self) -> None:
        self.nodes: dict[Hash, Node] = {}
        self.block_size = 0  # from the events: 0 until the first BlockStored
        self.evictions: deque[Eviction] = deque(maxlen=EVICTIONS_KEPT)
        self.partial = False  # set by the stream: blocks stored before the attach may be missing
        # parent hash (None for first blocks) -> its children's hashes, in the order stored (a dict as an
        # ordered set); kept for a parent that is not resident, whose children are then orphans.
        self._children: dict[Hash | None, dict[Hash, None]] = {}
        # (parent, token ids) -> hashes, for match. Siblings share token ids only when they differ in
        # vLLM's extra keys (LoRA, cache salt, images); any of them matches.
        self._index: dict[tuple[Hash | None, tuple[int, ...]], dict[Hash, None]] = {}
        self._missing_parents: dict[Hash, None] = {}  # non-resident parents with resident children, in order

    def __len__(self) -> int:
        return len(self.nodes)

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            match event:
                case BlockStored():
                    self.block_size = event.block_size
                    for block_hash, parent, token_ids in event.blocks():
                        self._store(Node(block_hash, parent, token_ids, batch.seq))
                case BlockRemoved():
                    for block_hash in event.block_hashes:
                        self._remove(block_hash, batch.seq)
                case AllBlocksCleared():
                    self.nodes.clear()
                    self._children.clear()
                    self._index.clear()
                    self._missing_parents.clear()
                    self.evictions.clear()

    def _store(self, node: Node) -> None:
        if node.hash in self.nodes:  # a block reported again (vLLM's "full" report mode) is the same block
            return
        self.nodes[node.hash] = node
        self._children.setdefault(node.parent, {})[node.hash] = None
        self._index.setdefault((node.parent, node.token_ids), {})[node.hash] = None
        if node.parent is not None and node.parent not in self.nodes:
            self._missing_parents[node.parent] = None
        self._missing_parents.pop(node.hash, None)  # stored again: its orphaned children are its own again

    def _remove(self, block_hash: Hash, seq: int) -> None:
        node = self.nodes.pop(block_hash, None)
        if node is None:  # stored before the attach
            return
        self.evictions.append(Eviction(seq, block_hash, len(node.token_ids)))
        _discard(self._children, node.parent, block_hash)
        _discard(self._index, (node.parent, node.token_ids), block_hash)
        if node.parent not in self._children:
            self._missing_parents.pop(node.parent, None)
        if block_hash in self._children:
            self._missing_parents[block_hash] = None

    def roots(self) -> list[Node]:
        """First blocks of sequences, then the orphans."""
        firsts = [self.nodes[h] for h in self._children.get(None, ())]
        return firsts + [self.nodes[h] for parent in self._missing_parents for h in self._children[parent]]

    def children(self, block_hash: Hash) -> list[Node]:
        return [self.nodes[h] for h in self._children.get(block_hash, ())]

    def orphan(self, block_hash: Hash) -> bool:
        """Whether the block's parent is unknown here (not resident)."""
        parent = self.nodes[block_hash].parent
        return parent is not None and parent not in self.nodes

    def match(self, token_ids: Sequence[int]) -> list[Hash]:
        """The hashes of the resident blocks that hold the longest prefix of `token_ids`, by whole blocks."""
        size = self.block_size
        matched: list[Hash] = []
        if not size:
            return matched
        parent: Hash | None = None
        for start in range(0, len(token_ids) // size * size, size):
            hashes = self._index.get((parent, tuple(token_ids[start:start + size])))
            if not hashes:
                break
            parent = next(iter(hashes))
            matched.append(parent)
        return matched


def _discard(table: dict[Any, dict[Hash, None]], key: Any, block_hash: Hash) -> None:
    members = table[key]
    del members[block_hash]
    if not members:
        del table[key]
