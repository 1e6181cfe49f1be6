"""The engine thread: the one thread that touches the LLMEngine.

Its users (the app's UI thread, the server's event loop) never call the engine. They queue commands
here; the thread applies them between steps, runs `step()` while there is work, and sleeps on a
condition when there is none, so an idle engine costs no CPU. It publishes the engine's immutable
`KVSnapshot` in `snapshot` for pollers: after every batch of commands, when the engine stops moving
(idle or paused), and after each step that follows a read of `snapshot`, since building one costs a
step ~1-2 ms at 16 chats and a headless server may have nobody reading; `fresh_snapshot` waits for one
as of now. A reply in progress can be polled too: the newest unfinished output of each request waits
in `progress(request_id)`. Every output of a request (each step that moved it) and every error go to
the `Sink` that asked for the request, called on this thread: a sink must hand them on without
blocking (the app posts a Textual message, the server wakes its event loop).
"""

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from pagedchat.engine.api.errors import one_line
from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.api.snapshot import KVSnapshot

log = logging.getLogger(__name__)

# A decode step is thousands of short torch calls, each of which lets go of the GIL and takes it
# back. With Python's default 5 ms switch interval each of those returns waits out the UI thread
# whenever it draws, so a frame cost the engine more than the frame's own CPU time (measured: a UI
# thread busy 10-20% of the time slowed steps 1.3-1.6 times as much; at 0.1 ms about as much).
GIL_SWITCH_INTERVAL_S = 1e-4


class Sink(Protocol):
    """Where one request's news goes; called on the engine thread."""

    def output(self, output: RequestOutput) -> None: ...  # each step that moved the request, the last one finished

    def error(self, request_id: str, error: str) -> None: ...  # a command or a step failed for it


class EngineThread:
    """Owns the engine and its thread. Every public method is called from another thread."""

    def __init__(self, engine, on_command: Callable[[], None] = lambda: None) -> None:
        self._engine = engine
        self._on_command = on_command  # tells the caller that the engine is about to move
        self._cond = threading.Condition()
        self._commands: deque[tuple[str | None, Callable[[], None]]] = deque()
        self._sinks: dict[str, Sink] = {}  # touched by the engine thread only
        self._unkept: set[str] = set()  # requests added without keep: forgotten when they finish
        self._progress: dict[str, RequestOutput] = {}  # written by the engine thread, read by pollers
        self._paused = False
        self._steps_allowed = 0  # steps granted by `step_once` while paused
        self._delay = 0.0  # slow motion: seconds between steps
        self._next_step_at = 0.0
        self._stopping = False
        self._switch_interval = sys.getswitchinterval()  # Python's own, given back at `stop`
        self._snapshot: KVSnapshot = engine.kv_snapshot()
        self._snapshot_read = False  # since the last one was published
        self._snapshot_callbacks: list[Callable[[KVSnapshot], None]] = []  # guarded by _cond
        self._ended = False  # the thread has left its loop: nothing more will be published
        self._thread = threading.Thread(target=self._run, name="pagedchat-engine", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the step in progress; the engine and its requests are left as they are."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        sys.setswitchinterval(self._switch_interval)

    # -- teaching mode -----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def delay(self) -> float:
        return self._delay

    def set_paused(self, paused: bool) -> None:
        self._on_command()
        with self._cond:
            self._paused = paused
            self._steps_allowed = 0
            self._cond.notify()

    def step_once(self) -> None:
        """While paused, let exactly one more step run."""
        self._on_command()
        with self._cond:
            self._steps_allowed += 1
            self._cond.notify()

    def set_delay(self, seconds: float) -> None:
        self._on_command()
        with self._cond:
            self._delay = max(0.0, seconds)
            self._next_step_at = 0.0
            self._cond.notify()

    @property
    def snapshot(self) -> KVSnapshot:
        """The newest published snapshot: current while the engine stands still; while it runs, one
        built after the previous read (by the next step or batch of commands)."""
        self._snapshot_read = True
        return self._snapshot

    def fresh_snapshot(self, callback: Callable[[KVSnapshot], None]) -> None:
        """Call back, on the engine thread, with a snapshot built after the step in progress (if any);
        at once, on this thread, once the engine thread has ended."""
        with self._cond:
            if not self._ended:
                self._snapshot_callbacks.append(callback)
                self._commands.append((None, lambda: None))  # wakes the thread, which publishes after commands
                self._cond.notify()
                return
        callback(self._snapshot)

    def progress(self, request_id: str) -> RequestOutput | None:
        """The newest output of a reply in progress; None before its first token and once it ended."""
        return self._progress.get(request_id)

    # -- commands ----------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink, keep: bool = True) -> None:
        """A new request; with keep (a conversation), it stays resident in the engine between turns."""

        def run() -> None:
            self._sinks[request_id] = sink
            if not keep:
                self._unkept.add(request_id)
            self._engine.add_request(request_id, prompt, params, keep=keep)

        self._submit(request_id, run)

    def continue_(self, request_id: str, new_ids: list[int], params: SamplingParams,
                  sink: Sink) -> None:
        def run() -> None:
            self._sinks[request_id] = sink
            self._engine.continue_request(request_id, new_ids, params)

        self._submit(request_id, run)

    def abort(self, request_id: str) -> None:
        """Stop the reply in progress; the engine reports it finished ("abort") at the next step and
        keeps the conversation parked with what it generated."""
        self._submit(request_id, lambda: self._engine.abort_request(request_id))

    def close(self, request_id: str) -> None:
        """End the conversation for good: the engine frees its blocks (into the prefix cache) and
        forgets its id."""

        def run() -> None:
            self._sinks.pop(request_id, None)
            self._unkept.discard(request_id)
            self._progress.pop(request_id, None)
            with contextlib.suppress(ValueError):  # a request whose add failed is unknown to the engine
                self._engine.close_request(request_id)

        self._submit(request_id, run)

    def fork(self, source_id: str, request_id: str, sink: Sink) -> None:
        def run() -> None:
            self._sinks[request_id] = sink
            self._engine.fork_request(source_id, request_id)

        self._submit(request_id, run)

    def _submit(self, request_id: str | None, command: Callable[[], None]) -> None:
        self._on_command()
        with self._cond:
            self._commands.append((request_id, command))
            self._cond.notify()

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while (work := self._next_work()) is not None:
            if work:
                for request_id, command in work:
                    self._apply(request_id, command)
                self._publish()
            else:
                self._step()
        with self._cond:
            self._ended = True
        self._call_back()

    def _publish(self) -> None:
        self._snapshot_read = False
        self._snapshot = self._engine.kv_snapshot()
        self._call_back()

    def _call_back(self) -> None:
        with self._cond:
            callbacks, self._snapshot_callbacks = self._snapshot_callbacks, []
        for callback in callbacks:
            callback(self._snapshot)

    def _next_work(self) -> list | None:
        """Sleep until there are commands (returned) or a step is due (an empty list); None when
        stopping. Commands go first, so a step is judged on the engine as they leave it."""
        with self._cond:
            while not self._stopping:
                if self._commands:
                    commands = list(self._commands)
                    self._commands.clear()
                    return commands
                wait = self._step_wait()
                if wait == 0:
                    if self._paused:
                        self._steps_allowed -= 1
                    return []
                self._cond.wait(wait)
        return None

    def _step_wait(self) -> float | None:
        """0 when a step may run now, seconds until slow motion allows one, None when none may."""
        if self._paused and not self._steps_allowed:
            return None
        if not self._engine.has_unfinished_requests():
            self._steps_allowed = 0  # a step granted with nothing to do is not kept for later
            return None
        if self._paused:
            return 0  # a granted single step ignores slow motion
        return max(0.0, self._next_step_at - time.monotonic())

    def _apply(self, request_id: str | None, command: Callable[[], None]) -> None:
        try:
            command()
        except Exception as exc:  # a bad command fails its own request only
            log.exception("engine command for %s failed", request_id)
            if request_id is not None:
                self._error(request_id, one_line(exc, with_type=True))
                if request_id in self._unkept:  # nothing more will come of it
                    self._unkept.discard(request_id)
                    self._sinks.pop(request_id, None)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_unfinished(one_line(exc, with_type=True))
            outputs = []
        self._next_step_at = time.monotonic() + self._delay
        if self._snapshot_read or self._paused or not self._engine.has_unfinished_requests():
            self._publish()  # before the sinks hear of the step, so that what they are told is in it
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._progress.pop(output.request_id, None)
                if output.request_id in self._unkept:  # the engine forgot it: so does this thread
                    self._unkept.discard(output.request_id)
                    del self._sinks[output.request_id]
            elif sink is not None:
                self._progress[output.request_id] = output
            if sink is not None:
                sink.output(output)

    def _fail_unfinished(self, error: str) -> None:
        """A step raised: stop every request it was working on, so the engine can go on serving."""
        busy = ("waiting", "running", "preempted")
        for request_id in dict.fromkeys(r.request_id for r in self._engine.kv_snapshot().requests if r.status in busy):
            try:
                self._engine.abort_request(request_id)
            except Exception:
                log.exception("abort after a failed step failed for %s", request_id)
            self._progress.pop(request_id, None)
            self._error(request_id, error)

    def _error(self, request_id: str, error: str) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.error(request_id, error)
