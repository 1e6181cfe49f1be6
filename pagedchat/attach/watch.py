"""The picture of an attached server's KV cache, kept current from what the server publishes.

`LogicalWatch` (vLLM): counts from /metrics, and with KV events the resident prefix blocks of each
data-parallel rank as a tree, each tab's tokens matched against it. vLLM publishes no block ids nor
block tables: the view never places a block anywhere. `GridWatch` (`pagedchat serve`): the server's
own snapshot, fetched again whenever its block events say something moved.

Both run as tasks on the caller's event loop and publish an immutable `snapshot`, for a poller.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pagedchat.attach.client import ApiClient, ApiError
from pagedchat.attach.kv_events import Hash, KVEventStream
from pagedchat.attach.metrics import ServerMetrics, rate
from pagedchat.attach.prefix_tree import Eviction, PrefixTree
from pagedchat.engine.api.snapshot import KVSnapshot

METRICS_EVERY_S = 0.33  # the 2-4 Hz
SNAPSHOT_EVERY_S = 0.1  # pagedchat serve: at most this often, however fast its events come
RETRY_S = 1.0  # after a failed scrape
MAX_TREE_BLOCKS = 500  # drawn per rank: a production pool holds far more than a panel can show

log = logging.getLogger(__name__)

Contexts = Callable[[], Mapping[str, Sequence[int]]]  # request id: its prompt and reply ids so far


@dataclass(frozen=True, slots=True)
class TreeBlock:
    block_hash: Hash
    parent: Hash | None
    token_ids: tuple[int, ...]
    orphan: bool  # its parent is not resident: stored before the view began, or evicted first


@dataclass(frozen=True, slots=True)
class RankView:
    rank: int
    block_size: int
    blocks: tuple[TreeBlock, ...]  # depth first: each parent before its children, MAX_TREE_BLOCKS at most
    not_drawn: int  # resident blocks past MAX_TREE_BLOCKS
    evictions: tuple[Eviction, ...]  # the newest last
    matches: Mapping[str, tuple[Hash, ...]]  # request id: the resident blocks that hold its prefix
    partial: bool  # some events before the attach could not be replayed
    problem: str | None  # why this rank's events stopped


@dataclass(frozen=True, slots=True)
class LogicalSnapshot:
    url: str
    metrics: ServerMetrics | None
    tokens_per_second: float
    hit_rate: float | None  # prefix-cache hits per token queried since the last scrape
    events: bool  # whether KV events were asked for
    ranks: tuple[RankView, ...]
    problem: str | None  # why the last scrape failed


class LogicalWatch:
    def __init__(self, client: ApiClient, contexts: Contexts, kv_events: tuple[str, str | None] | None = None,
                 dp_size: int | None = None) -> None:
        self._client = client
        self._contexts = contexts
        self._kv_events = kv_events
        self._dp_size = dp_size
        self._trees: dict[int, PrefixTree] = {}
        self._streams: list[KVEventStream] = []
        self._problems: dict[int, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._scrape: tuple[ServerMetrics, float] | None = None
        self._rate = (0.0, None)
        self._batches = 0  # event batches applied, over all ranks: the trees changed when it grows
        self._published: tuple | None = None  # what the snapshot was made from
        self.snapshot = LogicalSnapshot(client.base_url, None, 0.0, None, kv_events is not None, (), None)

    def start(self) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._poll_metrics()))

    async def stop(self) -> None:
        for stream in self._streams:
            stream.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _poll_metrics(self) -> None:
        while True:
            problem = None
            try:
                metrics = await self._client.metrics()
            except (ApiError, ValueError) as exc:  # ValueError: a /metrics that is not Prometheus text
                metrics, problem = (self._scrape[0] if self._scrape else None), f"/metrics: {exc}"
            else:
                now = time.monotonic()
                if self._scrape is not None:
                    step = rate(*self._scrape, metrics, now)
                    self._rate = (step.tokens_per_second, step.hit_rate)
                self._scrape = (metrics, now)
            # The events do not need the metrics: without them, the ranks are --dp-size's, else one.
            if self._kv_events is not None and not self._streams:
                self._follow(self._dp_size or (metrics.ranks if metrics else 1))
            self._publish(metrics, problem)
            await asyncio.sleep(RETRY_S if problem else METRICS_EVERY_S)

    def _follow(self, ranks: int) -> None:
        endpoint, replay = self._kv_events
        loop = asyncio.get_running_loop()
        for rank in range(ranks):
            self._trees[rank] = PrefixTree()
            stream = KVEventStream(endpoint, replay, rank)
            self._streams.append(stream)
            self._tasks.append(loop.create_task(self._take_events(stream)))

    async def _take_events(self, stream: KVEventStream) -> None:
        tree = self._trees[stream.rank]
        try:
            async for batch in stream.batches():
                tree.apply(batch)
                tree.partial = stream.partial
                self._batches += 1
        except ValueError as exc:
            self._problems[stream.rank] = f"undecodable KV events: {exc}"

    def _publish(self, metrics: ServerMetrics | None, problem: str | None) -> None:
        contexts = self._contexts()
        made_from = (metrics, problem, self._rate, self._batches, contexts, tuple(self._problems.items()))
        if made_from == self._published:  # an idle server: the same picture, so no redraw
            return
        self._published = made_from
        ranks = tuple(rank_view(rank, tree, contexts, self._problems.get(rank))
                      for rank, tree in self._trees.items())
        self.snapshot = LogicalSnapshot(self._client.base_url, metrics, *self._rate, self._kv_events is not None,
                                        ranks, problem)


def rank_view(rank: int, tree: PrefixTree, contexts: Mapping[str, Sequence[int]],
              problem: str | None = None) -> RankView:
    blocks: list[TreeBlock] = []
    stack = list(reversed(tree.roots()))
    while stack and len(blocks) < MAX_TREE_BLOCKS:
        node = stack.pop()
        blocks.append(TreeBlock(node.hash, node.parent, node.token_ids, tree.orphan(node.hash)))
        stack.extend(reversed(tree.children(node.hash)))
    matches = {request_id: tuple(tree.match(ids)) for request_id, ids in contexts.items()}
    return RankView(rank, tree.block_size, tuple(blocks), len(tree) - len(blocks), tuple(tree.evictions), matches,
                    tree.partial, problem)


class GridWatch:
    """`pagedchat serve`: its real snapshot, refetched when its block events report a change."""

    def __init__(self, client: ApiClient) -> None:
        self._client = client
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.snapshot: KVSnapshot | None = None
        self.problem: str | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        listener = asyncio.get_running_loop().create_task(self._listen())
        try:
            while True:
                try:
                    self.snapshot, self.problem = await self._client.kv_snapshot(), None
                except Exception as exc:  # a server of another version, say: said in the panel, tried again
                    self.problem = f"/v1/kv/snapshot: {exc}"
                    await asyncio.sleep(RETRY_S)
                    continue
                await asyncio.sleep(SNAPSHOT_EVERY_S)
                # Counts (tokens, rates) move without block events: refetch at least once a second.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), RETRY_S)
                self._changed.clear()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _listen(self) -> None:
        while True:
            try:
                async for _ in self._client.kv_events():
                    self._changed.set()
            except Exception:  # the events stopped: the snapshot is still fetched each second
                log.warning("the block events of %s stopped", self._client.base_url, exc_info=True)
                await asyncio.sleep(RETRY_S)
