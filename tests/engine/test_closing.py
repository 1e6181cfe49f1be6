"""Conversations end for good: `close_request` forgets them, and nothing the engine keeps grows with use."""

import gc
import itertools
import os
import random
import tracemalloc
from types import SimpleNamespace

import pytest
from support.engine import GREEDY, make_llm

from pagedchat import SamplingParams
from pagedchat.engine import llm_engine
from pagedchat.engine.core.invariants import assert_all_free, assert_invariants

ANSWER = SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY)


def converse(engine, rng: random.Random, number: int) -> None:
    """Open a conversation, answer it (or stop it half-way, one in ten), close it."""
    request_id = f"chat-{number}"
    engine.add_request(request_id, [rng.randrange(250) for _ in range(rng.randrange(2, 20))], ANSWER, keep=True)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if number % 10 == 0 and steps == 2:
            break
    engine.close_request(request_id)
    while engine.has_unfinished_requests():  # the closed request's last output
        engine.step()


def fake_clock(monkeypatch) -> None:
    """The engine's clock ticks a second per reading: the rate window holds a few steps, never more."""
    ticks = itertools.count()
    monkeypatch.setattr(llm_engine, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))


def test_a_thousand_closed_conversations_leave_nothing_behind(tiny_model, monkeypatch):
    fake_clock(monkeypatch)
    engine = make_llm(tiny_model, block_size=4, num_kv_blocks=64, num_threads=1).engine
    rng = random.Random(7)
    tracemalloc.start()  # from the start, so that what bounded state replaces is not counted as growth
    try:
        for number in range(1000):
            converse(engine, rng, number)
        snap = engine.kv_snapshot()
        gc.collect()  # torch's garbage in reference cycles is not growth
        at_1000 = tracemalloc.take_snapshot()
        for number in range(1000, 2000):
            converse(engine, rng, number)
        snap = engine.kv_snapshot()  # in place of the first, which would keep its events alive beside the new
        gc.collect()
        at_2000 = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert not engine.groups and not engine.scheduler.parked and not engine.scheduler.waiting
    assert snap.requests == () and not snap.block_tables and snap.num_parked == 0
    assert_all_free(snap)
    assert snap.num_cached_blocks > 0, "closed conversations' blocks stay in the prefix cache"
    # The engine's own allocations: other threads of the test process (a suite leaves some) allocate too.
    ours = [tracemalloc.Filter(True, f"*{os.sep}{folder}{os.sep}*") for folder in ("pagedchat", "kernels")]
    grown = sum(stat.size_diff for stat in at_2000.filter_traces(ours).compare_to(at_1000.filter_traces(ours),
                                                                                   "filename"))
    assert grown < 64 * 1024, f"the heap grew by {grown} bytes over 1,000 conversations"


def test_close_request_aborts_frees_and_forgets(tiny_model):
    engine = make_llm(tiny_model, block_size=4).engine
    params = SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY)
    prompt = list(range(40, 53))
    engine.add_request("a", prompt, params, keep=True)
    engine.add_request("b", prompt, params, keep=True)
    for _ in range(3):
        engine.step()
    engine.close_request("a")
    snap = engine.kv_snapshot()
    assert_invariants(snap)
    assert [r.request_id for r in snap.requests] == ["b"] and "a" not in snap.block_tables
    assert all(block.owners in ((), ("b",)) for block in snap.blocks)
    outs = {out.request_id: out for out in engine.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort" and len(outs["a"].token_ids) >= 2
    assert not outs["b"].finished
    with pytest.raises(ValueError, match="unknown request id"):
        engine.close_request("a")
    with pytest.raises(ValueError, match="unknown request id"):
        engine.close_request("never-added")

    engine.add_request("a", prompt, SamplingParams(max_tokens=2, **GREEDY))  # the id is free again
    outs = {}
    while "a" not in outs:
        outs |= {out.request_id: out for out in engine.step() if out.finished}
    assert outs["a"].num_cached_tokens == 12, "the closed conversation's full blocks served the same prompt"
    engine.close_request("b")
    engine.step()
    snap = engine.kv_snapshot()
    assert snap.requests == () and not engine.has_unfinished_requests()
    assert_all_free(snap)


def test_a_parked_conversation_closes_without_another_output(tiny_model):
    engine = make_llm(tiny_model, block_size=4).engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), keep=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_snapshot().requests[0].status == "parked"
    engine.close_request("a")
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_all_free(engine.kv_snapshot())


def test_every_request_the_snapshot_lists_can_be_closed(tiny_model):
    """Finished requests without keep are forgotten at the step that ends them; every id the snapshot
    lists is one the engine knows, and a sample's own id is not the request's."""
    engine = make_llm(tiny_model, block_size=4).engine
    engine.add_request("quick", [1, 2, 3], SamplingParams(max_tokens=1, **GREEDY))
    engine.add_request("long", [1, 2, 4], SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY))
    engine.add_request("kept", [1, 2, 5], SamplingParams(max_tokens=1, **GREEDY), keep=True)
    engine.add_request("three", [9, 8, 7], SamplingParams(n=3, max_tokens=20, ignore_eos=True, seed=1))
    engine.step()
    snap = engine.kv_snapshot()
    assert {r.request_id for r in snap.requests} == {"long", "kept", "three"}
    three = [r for r in snap.requests if r.request_id == "three"]
    assert sorted(r.seq_id for r in three) == ["three", "three#1", "three#2"]
    assert set(snap.block_tables) == {r.seq_id for r in snap.requests}
    assert any(e.request_id == "quick" for e in snap.events if e.step == snap.step)
    for request_id in {r.request_id for r in snap.requests}:
        engine.close_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_snapshot().requests == ()
    assert_all_free(engine.kv_snapshot())


def test_the_rate_window_is_trimmed_as_steps_add_to_it(tiny_model, monkeypatch):
    llm = make_llm(tiny_model, block_size=4)
    fake_clock(monkeypatch)
    llm.generate([list(range(10, 20))], SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY))
    assert len(llm.engine._rate) <= llm_engine.RATE_WINDOW_S + 1
