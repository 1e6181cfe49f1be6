"""The engine thread against a scripted engine: it sleeps when idle, pauses and steps, and keeps
serving when a command or a step fails."""

import sys
import threading
import time

import pytest

from test_tui_support import make_snapshot

from pagedchat.engine.outputs import CompletionOutput, RequestOutput
from pagedchat.engine.params import SamplingParams
from pagedchat.tui.worker import GIL_SWITCH_INTERVAL_S, EngineError, EngineOutput, EngineWorker

PARAMS = SamplingParams(max_tokens=4)


class ScriptedEngine:
    """Each request gets one token per step until it has `max_tokens`; `fail_next_step` raises once."""

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.steps = 0
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

    def finished(self) -> bool:
        with self.lock:
            return any(isinstance(m, EngineError) or (isinstance(m, EngineOutput) and m.output.finished)
                       for m in self.messages)


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def started(engine: ScriptedEngine) -> EngineWorker:
    worker = EngineWorker(engine)
    worker.start()
    return worker


def test_runs_requests_to_the_end_then_sleeps():
    engine = ScriptedEngine()
    worker = started(engine)
    a, b = Sink(), Sink()
    worker.add("a", [1], PARAMS, a)
    worker.add("b", [1], SamplingParams(max_tokens=2), b)
    wait_for(lambda: a.finished() and b.finished())
    assert [m.output.finish_reason for m in a.messages + b.messages] == ["length", "length"]  # the ends only
    assert worker.progress("a") is worker.progress("b") is None
    steps = engine.steps
    time.sleep(0.1)
    assert engine.steps == steps == 4  # idle: no step runs without work
    assert worker.snapshot.step == 4
    worker.stop()


def test_the_gil_changes_hands_often_while_the_engine_thread_runs():
    before = sys.getswitchinterval()
    assert before != pytest.approx(GIL_SWITCH_INTERVAL_S)
    worker = started(ScriptedEngine())
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    worker.stop()
    assert sys.getswitchinterval() == before


def test_a_reply_in_progress_is_polled_and_only_its_end_is_posted():
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
    worker.stop()


def test_pause_and_single_steps():
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_paused(True)
    sink = Sink()
    worker.add("a", [1], PARAMS, sink)
    time.sleep(0.1)
    assert engine.steps == 0
    worker.step_once()
    wait_for(lambda: engine.steps == 1)
    time.sleep(0.05)
    assert engine.steps == 1  # exactly one
    worker.set_paused(False)
    wait_for(sink.finished)
    worker.stop()


def test_slow_motion_spaces_steps():
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_delay(0.1)
    sink = Sink()
    started_at = time.monotonic()
    worker.add("a", [1], PARAMS, sink)
    wait_for(sink.finished)
    assert time.monotonic() - started_at >= 0.3  # 4 steps, 3 gaps
    worker.stop()


def test_a_failing_command_fails_its_request_only():
    engine = ScriptedEngine()
    worker = started(engine)
    good, bad = Sink(), Sink()
    worker.add("good", [1], PARAMS, good)
    worker.continue_("nope", [1], PARAMS, bad)
    wait_for(lambda: good.finished() and bad.finished())
    assert [m.error for m in bad.messages] == ["ValueError: unknown request id 'nope'"]
    assert all(isinstance(m, EngineOutput) for m in good.messages)
    worker.stop()


def test_a_failing_step_fails_what_ran_and_the_engine_serves_on():
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
    worker.stop()


def test_released_requests_post_nothing_more():
    engine = ScriptedEngine()
    worker = started(engine)
    worker.set_paused(True)
    sink = Sink()
    worker.add("a", [1], PARAMS, sink)
    worker.close("a")
    worker.set_paused(False)
    time.sleep(0.1)
    assert sink.messages == [] and engine.steps == 0
    worker.stop()
