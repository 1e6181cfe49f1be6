"""The engine thread as the server's event loop sees it: each request's outputs on an asyncio queue."""

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedchat.engine.runtime.engine_thread import EngineThread
from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.api.snapshot import KVSnapshot


class EngineFailure(Exception):
    """A command or a step failed for this request."""

    status = 500


class Stopping(EngineFailure):
    """The server is shutting down: every request ends."""

    status = 503


LEFT = object()  # on a request's queue: its client is gone


class LoopPost:
    """Hands items to asyncio queues from the engine thread, waking the loop once for all that one step
    produced rather than once per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def put(self, queue: asyncio.Queue, item: object) -> None:
        with self._lock:
            self._pending.append((queue, item))
            wake = len(self._pending) == 1
        if wake and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)


@dataclass(frozen=True, slots=True)
class QueueSink:
    post: LoopPost
    queue: asyncio.Queue

    def output(self, output: RequestOutput) -> None:
        self.post.put(self.queue, output)

    def error(self, request_id: str, error: str) -> None:
        self.post.put(self.queue, EngineFailure(error))


class AsyncEngine:
    def __init__(self, thread: EngineThread, loop: asyncio.AbstractEventLoop) -> None:
        self.thread = thread
        self._post = LoopPost(loop)
        self._queues: set[asyncio.Queue] = set()  # of the requests in flight

    def stop_all(self) -> None:
        """End every request in flight now (each raises Stopping); on the event loop."""
        for queue in self._queues:
            queue.put_nowait(Stopping("the server is shutting down"))

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, keep: bool = False,
                       continued: bool = False, until: asyncio.Future | None = None) -> AsyncIterator[RequestOutput]:
        """Every output of the request until its last; a new request, or the next turn of a kept one.
        Leaving early (a client gone: `until` done, or the iteration left) stops it at once: aborted, or
        closed if it was kept."""
        queue: asyncio.Queue = asyncio.Queue()
        if until is not None:  # one callback, not a task raced against each output
            until.add_done_callback(lambda _: queue.put_nowait(LEFT))
        sink = QueueSink(self._post, queue)
        if continued:
            self.thread.continue_(request_id, prompt, params, sink)
        else:
            self.thread.add(request_id, prompt, params, sink, keep=keep)
        finished = False
        self._queues.add(queue)
        try:
            while not finished:
                item = await queue.get()
                if item is LEFT:
                    return
                if isinstance(item, Stopping):  # the server's, not the engine thread's: the request still runs
                    raise item
                finished = isinstance(item, EngineFailure) or item.finished
                if isinstance(item, EngineFailure):  # the engine thread has already stopped it
                    raise item
                yield item
        finally:
            self._queues.discard(queue)
            if not finished:
                (self.thread.close if keep else self.thread.abort)(request_id)

    def close(self, request_id: str) -> None:
        self.thread.close(request_id)

    async def snapshot(self) -> KVSnapshot:
        """The engine's snapshot as of now (built after the step in progress, if one is)."""
        queue: asyncio.Queue = asyncio.Queue()
        self.thread.fresh_snapshot(lambda snapshot: self._post.put(queue, snapshot))
        return await queue.get()
