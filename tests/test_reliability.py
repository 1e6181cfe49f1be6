"""Long random runs, fairness and odd model output: nothing leaks, nothing starves, nothing crashes."""

import random

import torch
from invariants import assert_all_free, assert_invariants
from test_engine import GREEDY, make_llm

from pagedchat import SamplingParams


def lone_run(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("lone", prompt, params)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return out.token_ids


def test_soak_random_arrivals_aborts_forks_and_closes(tiny_model):
    """Random traffic against a pool small enough to preempt often; afterwards every request that was not
    aborted has exactly the tokens it gets alone, and every block is back in the pool."""
    rng = random.Random(2024)
    engine = make_llm(tiny_model, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=8).engine
    origin: dict[str, tuple[list[int], SamplingParams]] = {}  # request -> the prompt and params it answers
    aborted: set[str] = set()
    finished: dict[str, list[int]] = {}
    parked: list[str] = []
    for step in range(260):
        if step < 200 and rng.random() < 0.3:
            rid = f"q{step}"
            prompt = [rng.randrange(250) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(max_tokens=rng.randint(1, 20), **GREEDY)
            keep = rng.random() < 0.3
            engine.add_request(rid, prompt, params, keep=keep)
            origin[rid] = (prompt, params)
        running = [r.request_id for r in engine.kv_snapshot().requests if r.status == "running"]
        if running and rng.random() < 0.04:
            victim = rng.choice(running)
            engine.abort_request(victim)
            aborted.add(victim)
        if running and rng.random() < 0.04:
            src = rng.choice(running)
            twin = f"{src}/fork{step}"
            engine.fork_request(src, twin)
            origin[twin] = origin[src]
            if src in aborted:
                aborted.add(twin)
        if parked and rng.random() < 0.2:
            engine.release_request(parked.pop(rng.randrange(len(parked))))  # a tab closed
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                finished[out.request_id] = out.token_ids
                if out.request_id in {r.request_id for r in engine.kv_snapshot().requests if r.status == "parked"}:
                    parked.append(out.request_id)
        assert_invariants(engine.kv_snapshot())
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                finished[out.request_id] = out.token_ids
        assert_invariants(engine.kv_snapshot())
    for rid in parked + [r.request_id for r in engine.kv_snapshot().requests]:
        engine.release_request(rid)
    snap = engine.kv_snapshot()
    assert_all_free(snap)
    assert snap.num_preemptions > 0, "the pool was meant to run dry"
    assert any(e.kind == "cow" for e in snap.events) or any("fork" in rid for rid in finished)

    reference = make_llm(tiny_model, block_size=4, num_kv_blocks=40).engine
    checked = 0
    for rid, tokens in finished.items():
        if rid in aborted:
            continue
        prompt, params = origin[rid]
        assert tokens == lone_run(reference, prompt, params), rid
        checked += 1
    assert checked >= 30


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
