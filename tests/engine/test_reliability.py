"""Long random runs, fairness and odd model output: nothing leaks, nothing starves, nothing crashes."""

import random

import torch
from support.engine import GREEDY, make_llm

from bench import soak
from pagedchat import SamplingParams
from pagedchat.engine.core.invariants import assert_all_free


def test_soak_random_arrivals_aborts_forks_and_closes(tiny_model):
    """Random traffic against a pool small enough to preempt often (bench/soak.py at a test's size);
    afterwards every request that was not aborted has exactly the tokens it gets alone, and every block
    is back in the pool."""
    engine = make_llm(tiny_model, **soak.POOL).engine
    done = soak.soak(engine, soak.Traffic(steps=200, vocab=engine.runner.model.config.vocab_size), seed=2024)
    assert done.leaked_blocks == 0
    assert_all_free(engine.kv_snapshot())
    assert done.checks > done.steps >= 200
    assert done.preemptions > 0, "the pool was meant to run dry"
    assert done.forks and done.cow_copies and done.follow_ups and done.closes and done.aborted
    assert not done.errors
    reference = make_llm(tiny_model, block_size=soak.POOL["block_size"], num_kv_blocks=soak.POOL["num_kv_blocks"]).engine
    assert len(done.answers) >= 30
    assert soak.mismatches(reference, done) == []


def test_no_request_starves_under_constant_load(tiny_model):
    """FCFS with preempted requests at the front: under a steady stream every request starts in bounded time."""
    rng = random.Random(5)
    engine = make_llm(tiny_model, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4).engine
    added: dict[str, int] = {}
    started: dict[str, int] = {}
    for step in range(300):
        if step % 3 == 0:
            rid = f"r{step}"
            engine.add_request(rid, [rng.randrange(250) for _ in range(rng.randint(4, 20))],
                               SamplingParams(max_tokens=rng.randint(4, 12), ignore_eos=True, **GREEDY))
            added[rid] = step
        engine.step()
        for r in engine.kv_snapshot().requests:
            if r.status == "running":
                started.setdefault(r.request_id, step)
    waits = [started[rid] - added[rid] for rid in added if rid in started]
    waiting_now = [rid for rid in added if rid not in started]
    assert len(waits) > 60
    assert max(waits) <= 60, f"a request waited {max(waits)} steps"
    assert all(300 - added[rid] <= 60 for rid in waiting_now)


def test_invalid_utf8_mid_character_is_shown_not_raised(tiny_model):
    """A model may stop in the middle of a multi-byte character: the text shows U+FFFD, nothing raises."""
    llm = make_llm(tiny_model)
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    lead_byte = tokenizer.encode("é", add_special_tokens=False)[0]  # the first of its two byte tokens
    original = engine.runner.forward
    engine.runner.forward = lambda batch: torch.full_like(original(batch), -1e9).index_fill_(1, torch.tensor([lead_byte]), 0)
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].new_text)
            final = out
    assert final.finish_reason == "length" and final.token_ids == [lead_byte] * 3
    assert "\ufffd" in final.text and "".join(pieces) == final.text
