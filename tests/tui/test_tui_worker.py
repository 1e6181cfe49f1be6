"""The engine thread against a scripted engine: it sleeps when idle, pauses and steps, and keeps
serving when a command or a step fails."""

import sys
import threading
import time

import pytest
from support.tui import make_snapshot
from support.worker import idle, watch

from pagedchat.engine.api.outputs import CompletionOutput, RequestOutput
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.runtime.engine_thread import GIL_SWITCH_INTERVAL_S, EngineThread
from pagedchat.tui.worker import EngineError, EngineOutput, WidgetSink

PARAMS = SamplingParams(max_tokens=4)


class ScriptedEngine:
    """Each request gets one token per step until it has `max_tokens`; `fail_next_step` raises once."""

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.steps = 0
        self.step_times: list[float] = []
        self.fail_next_step = False

    def add_request(self, request_id, prompt, params, keep=False):
        if request_id in self.remaining:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.remaining[request_id] = params.max_tokens

    def continue_request(self, request_id, new_token_ids, params):
        raise ValueError(f"unknown request id {request_id!r}")

    def abort_request(self, request_id):
        self.remaining[request_id] = 0

    def close_request(self, request_id):
        self.remaining.pop(request_id, None)

    def has_unfinished_requests(self):
        return any(self.remaining.values())

    def step(self):
        self.steps += 1
        self.step_times.append(time.monotonic())
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected fault\nsecond line")
        outputs = []
        for request_id, left in self.remaining.items():
            if left:
                self.remaining[request_id] = left - 1
                done = left == 1
                completion = CompletionOutput(0, [1], "x", [1], "x", "length" if done else None)
                outputs.append(RequestOutput(request_id, [], [completion], done))
        return outputs

    def kv_snapshot(self):
        statuses = {rid: "running" if left else "parked" for rid, left in self.remaining.items()}
        return make_snapshot(step=self.steps, tables={rid: [] for rid in self.remaining}, statuses=statuses)


class Sink:
    """Stands in for a chat pane: collects what the engine thread posts."""

    def __init__(self) -> None:
        self.messages = []
        self.lock = threading.Lock()

    def post_message(self, message) -> bool:
        with self.lock:
            self.messages.append(message)
        return True

    def output(self, output) -> None:  # the Sink protocol, as the app's panes take it
        WidgetSink(self).output(output)

    def error(self, request_id: str, error: str) -> None:
        WidgetSink(self).error(request_id, error)

    def finished(self) -> bool:
        with self.lock:
            return any(isinstance(m, EngineError) or (isinstance(m, EngineOutput) and m.output.finished)
                       for m in self.messages)


def wait_for(condition, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.005)


def wait_idle(worker: EngineThread) -> None:
    """Until the engine thread has taken in every call made so far and sleeps with nothing to do."""
    wait_for(lambda: idle(worker), what="the engine thread to go to sleep")


@pytest.fixture
def started():
    """Start a (watched) worker on an engine; every worker is stopped at the end of the test, even one
    that fails, so that the GIL switch interval is Python's own again for the next test."""
    interval = sys.getswitchinterval()
    workers: list[EngineThread] = []

    def start(engine) -> EngineThread:
        worker = watch(EngineThread(engine))
        workers.append(worker)
        worker.start()
        return worker

    yield start
    for worker in reversed(workers):
        worker.stop()
    assert not any(worker._thread.is_alive() for worker in workers), "a worker's thread did not stop"
    assert sys.getswitchinterval() == interval


def test_runs_requests_to_the_end_then_sleeps(started):
    engine = ScriptedEngine()
    worker = started(engine)
    a, b = Sink(), Sink()
    worker.add("a", [1], PARAMS, a)
    worker.add("b", [1], SamplingParams(max_tokens=2), b)
    wait_for(lambda: a.finished() and b.finished())
    assert [m.output.finish_reason for m in a.messages + b.messages] == ["length", "length"]  # the ends only
    assert worker.progress("a") is worker.progress("b") is None
    wait_idle(worker)  # asleep: a thread that kept stepping without work would never get here
    assert engine.steps == 4
    assert worker.snapshot.step == 4


def test_the_gil_changes_hands_often_while_the_engine_thread_runs(started):
    before = sys.getswitchinterval()
    assert before != pytest.approx(GIL_SWITCH_INTERVAL_S)
    worker = started(ScriptedEngine())
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    worker.stop()
    assert sys.getswitchinterval() == before


def test_a_reply_in_progress_is_polled_and_only_its_end_is_posted(started):
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_paused(True)
    sink, closed = Sink(), Sink()
    worker.add("a", [1], PARAMS, sink)
    worker.add("closed", [1], PARAMS, closed)
    for step in (1, 2):
        worker.step_once()
        wait_for(lambda: engine.steps == step)
        wait_for(lambda: worker.progress("a") is not None and worker.progress("closed") is not None)
        assert worker.progress("a").outputs[0].finish_reason is None and sink.messages == []
    worker.close("closed")  # a tab closed while its reply ran: nothing of it stays behind
    wait_for(lambda: worker.progress("closed") is None)
    worker.set_paused(False)
    wait_for(sink.finished)
    assert worker.progress("a") is None and len(sink.messages) == 1 and closed.messages == []


def test_pause_and_single_steps(started):
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_paused(True)
    sink = Sink()
    worker.add("a", [1], PARAMS, sink)
    wait_idle(worker)
    assert "a" in worker.snapshot.block_tables  # the request is in: paused, not idle
    assert engine.steps == 0
    for steps in (1, 2):
        worker.step_once()
        wait_idle(worker)
        assert engine.steps == steps  # exactly one more
    assert worker.snapshot.step == 2 and engine.remaining["a"] == 2
    worker.set_paused(False)
    wait_for(sink.finished)
    assert engine.steps == 4


def test_slow_motion_spaces_steps(started):
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_delay(0.1)
    sink = Sink()
    worker.add("a", [1], PARAMS, sink)
    wait_for(sink.finished)
    # A lower bound only, which the worker guarantees: it waits for the monotonic clock to reach
    # the step's time (taken as the previous step ended) before it runs the next.
    gaps = [later - earlier for earlier, later in zip(engine.step_times, engine.step_times[1:])]
    assert len(gaps) == 3 and min(gaps) >= 0.1


def test_a_failing_command_fails_its_request_only(started):
    engine = ScriptedEngine()
    worker = started(engine)
    good, bad = Sink(), Sink()
    worker.add("good", [1], PARAMS, good)
    worker.continue_("nope", [1], PARAMS, bad)
    wait_for(lambda: good.finished() and bad.finished())
    assert [m.error for m in bad.messages] == ["ValueError: unknown request id 'nope'"]
    assert all(isinstance(m, EngineOutput) for m in good.messages)


def test_a_failing_step_fails_what_ran_and_the_engine_serves_on(started):
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_paused(True)
    first = Sink()
    worker.add("first", [1], PARAMS, first)
    engine.fail_next_step = True
    worker.step_once()
    wait_for(first.finished)
    assert first.messages[-1].error == "RuntimeError: injected fault"
    worker.set_paused(False)
    later = Sink()
    worker.add("later", [1], PARAMS, later)
    wait_for(later.finished)
    assert later.messages[-1].output.finish_reason == "length"


def test_closed_requests_post_nothing_more(started):
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_paused(True)
    sink = Sink()
    worker.add("a", [1], PARAMS, sink)
    worker.close("a")
    worker.set_paused(False)
    wait_idle(worker)
    assert "a" not in engine.remaining  # closed in the engine, not merely forgotten by the worker
    assert sink.messages == [] and engine.steps == 0


class CountedSnapshots(ScriptedEngine):
    """Counts the snapshots built, and runs each step `step_s` long."""

    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__()
        self.step_s = step_s
        self.snapshots_built = 0

    def step(self):
        time.sleep(self.step_s)
        return super().step()

    def kv_snapshot(self):
        self.snapshots_built += 1
        return super().kv_snapshot()


def test_a_busy_engine_nobody_reads_builds_no_snapshot_per_step(started):
    engine = CountedSnapshots()
    worker = started(engine)
    sink = Sink()
    worker.add("a", [1], SamplingParams(max_tokens=50), sink)
    wait_for(sink.finished)
    wait_idle(worker)
    assert engine.steps == 50
    assert engine.snapshots_built <= 3  # at the start, after the command, when it went idle
    assert worker.snapshot.step == 50  # idle: current


def test_a_reader_gets_a_snapshot_built_after_its_read(started):
    engine = CountedSnapshots(step_s=0.01)
    worker = started(engine)
    sink = Sink()
    worker.add("a", [1], SamplingParams(max_tokens=30), sink)
    seen = []
    while not sink.finished():
        asked_at = engine.steps
        worker.snapshot
        wait_for(lambda: engine.steps >= asked_at + 2 or sink.finished())
        seen.append((asked_at, worker.snapshot.step))
    assert all(step >= asked_at for asked_at, step in seen)  # each built after the read before it
    assert engine.snapshots_built < engine.steps  # not one a step: only after reads


def test_fresh_snapshot_is_as_of_after_the_step_in_progress(started):
    engine = CountedSnapshots(step_s=0.02)
    worker = started(engine)
    sink = Sink()
    worker.add("a", [1], SamplingParams(max_tokens=20), sink)
    wait_for(lambda: engine.steps >= 3)
    got = []
    asked_at = engine.steps
    worker.fresh_snapshot(got.append)
    wait_for(lambda: got)
    assert got[0].step >= asked_at
    worker.stop()
    late = []
    worker.fresh_snapshot(late.append)  # the thread has ended: at once, with the last one
    assert late == [worker.snapshot]
