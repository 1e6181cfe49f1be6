"""The engine thread: the one thread that touches the LLMEngine.

The UI never calls the engine. It queues commands here; the thread applies them between steps, runs
`step()` while there is work, and sleeps on a condition when there is none, so an idle app costs no
CPU. After every step or batch of commands it publishes the engine's immutable `KVSnapshot` in
`snapshot`, which the UI polls. A reply in progress is polled too: the newest unfinished output
of each request waits in `progress(request_id)`, since the UI draws at most a few times a second and
a message per token costs the UI thread (and so the engine: they share the GIL) for nothing. The
end of a reply and every error go to the widget that asked for the request, by `post_message` on
that widget: posting to the widget (not the App) is safe at shutdown, and it never blocks this
thread the way `call_from_thread` would.
"""

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from textual.message import Message
from textual.message_pump import MessagePump

from pagedchat.engine.errors import one_line
from pagedchat.engine.outputs import RequestOutput
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.snapshot import KVSnapshot

log = logging.getLogger(__name__)

# A decode step is thousands of short torch calls, each of which lets go of the GIL and takes it
# back. With Python's default 5 ms switch interval each of those returns waits out the UI thread
# whenever it draws, so a frame cost the engine more than the frame's own CPU time (measured: a UI
# thread busy 10-20% of the time slowed steps 1.3-1.6 times as much; at 0.1 ms about as much).
GIL_SWITCH_INTERVAL_S = 1e-4


class EngineOutput(Message):
    """A request finished: its whole reply, and why it ended."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__()
        self.output = output


class EngineError(Message):
    """A command or a step failed for this request; the other requests go on."""

    def __init__(self, request_id: str, error: str) -> None:
        super().__init__()
        self.request_id = request_id
        self.error = error


class EngineWorker:
    """Owns the engine and its thread. Every public method is called from the UI thread."""

    def __init__(self, engine, on_command: Callable[[], None] = lambda: None) -> None:
        self._engine = engine
        self._on_command = on_command  # tells the UI that the engine is about to move
        self._cond = threading.Condition()
        self._commands: deque[tuple[str | None, Callable[[], None]]] = deque()
        self._sinks: dict[str, MessagePump] = {}  # touched by the engine thread only
        self._progress: dict[str, RequestOutput] = {}  # written by the engine thread, read by the UI
        self._paused = False
        self._steps_allowed = 0  # steps granted by `step_once` while paused
        self._delay = 0.0  # slow motion: seconds between steps
        self._next_step_at = 0.0
        self._stopping = False
        self._switch_interval = sys.getswitchinterval()  # Python's own, given back at `stop`
        self.snapshot: KVSnapshot = engine.kv_snapshot()
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

    def progress(self, request_id: str) -> RequestOutput | None:
        """The newest output of a reply in progress; None before its first token and once it ended."""
        return self._progress.get(request_id)

    # -- commands ----------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: MessagePump) -> None:
        """A new conversation: kept resident in the engine between turns (keep=True)."""

        def run() -> None:
            self._sinks[request_id] = sink
            self._engine.add_request(request_id, prompt, params, keep=True)

        self._submit(request_id, run)

    def continue_(self, request_id: str, new_ids: list[int], params: SamplingParams,
                  sink: MessagePump) -> None:
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
            self._progress.pop(request_id, None)
            with contextlib.suppress(ValueError):  # a request whose add failed is unknown to the engine
                self._engine.close_request(request_id)

        self._submit(request_id, run)

    def fork(self, source_id: str, request_id: str, sink: MessagePump) -> None:
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
                self.snapshot = self._engine.kv_snapshot()
            else:
                self._step()

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
                self._post(request_id, EngineError(request_id, one_line(exc, with_type=True)))

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_unfinished(one_line(exc, with_type=True))
            outputs = []
        self._next_step_at = time.monotonic() + self._delay
        self.snapshot = self._engine.kv_snapshot()
        for output in outputs:
            if output.finished:
                self._progress.pop(output.request_id, None)
                self._post(output.request_id, EngineOutput(output))
            elif output.request_id in self._sinks:
                self._progress[output.request_id] = output

    def _fail_unfinished(self, error: str) -> None:
        """A step raised: stop every request it was working on, so the engine can go on serving."""
        busy = ("waiting", "running", "preempted")
        for request_id in dict.fromkeys(r.request_id for r in self._engine.kv_snapshot().requests if r.status in busy):
            try:
                self._engine.abort_request(request_id)
            except Exception:
                log.exception("abort after a failed step failed for %s", request_id)
            self._progress.pop(request_id, None)
            self._post(request_id, EngineError(request_id, error))

    def _post(self, request_id: str, message: Message) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.post_message(message)
