"""Forks, copy-on-write and parallel samples: shared blocks are stored once and behave like copies."""

from support.engine import GREEDY, hf_greedy, make_llm, run_to_end

from pagedchat import SamplingParams
from pagedchat.engine.chat import ChatSession
from pagedchat.engine.core.invariants import assert_all_free, assert_invariants


def test_forked_conversation_branches_match_hf(tiny_model):
    llm = make_llm(tiny_model, block_size=8)
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    params = SamplingParams(max_tokens=11, **GREEDY)
    trunk = ChatSession(tokenizer)
    engine.add_request("a", trunk.user_turn("Where shall we go?"), params, keep=True)
    trunk.add_reply(run_to_end(engine)["a"].token_ids)

    engine.fork_request("a", "b")
    snap = engine.kv_snapshot()
    assert_invariants(snap)
    table = snap.block_tables["a"]
    assert snap.block_tables["b"] == table
    assert all(snap.blocks[block_id].ref_count == 2 for block_id in table)
    assert {r.status for r in snap.requests} == {"parked"}

    branch = ChatSession(tokenizer)
    branch.messages, branch.token_ids = list(trunk.messages), list(trunk.token_ids)
    branch._rendered, branch._reply_ids = trunk._rendered, trunk._reply_ids
    engine.continue_request("a", trunk.user_turn("To the sea."), params)
    engine.continue_request("b", branch.user_turn("To the mountains, then."), params)
    outs = run_to_end(engine)
    assert outs["a"].token_ids == hf_greedy(tiny_model, trunk.token_ids, 11)
    assert outs["b"].token_ids == hf_greedy(tiny_model, branch.token_ids, 11)

    snap = engine.kv_snapshot()
    assert_invariants(snap)
    cows = [e for e in snap.events if e.kind == "cow"]
    assert len(cows) == 1, "only the partial last block is copied, and only by the first writer"
    full_shared = table[:-1]
    assert all(snap.blocks[b].ref_count == 2 for b in full_shared)
    assert snap.blocks[table[-1]].ref_count == 1
    engine.release_request("a")
    engine.release_request("b")
    assert_all_free(engine.kv_snapshot())


def test_fork_of_a_running_request_continues_identically(tiny_model):
    engine = make_llm(tiny_model, block_size=8).engine
    prompt = list(range(30, 51))
    params = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
    engine.add_request("src", prompt, params)
    while engine.kv_snapshot().requests[0].num_computed_tokens % 8 == 0:  # fork mid-block: the next write copies
        engine.step()
    engine.fork_request("src", "dst")
    outs = run_to_end(engine)
    assert outs["src"].token_ids == outs["dst"].token_ids == hf_greedy(tiny_model, prompt, 16, min_new_tokens=16)
    assert any(e.kind == "cow" for e in engine.kv_snapshot().events)
    assert_all_free(engine.kv_snapshot())


def test_forks_past_the_sequence_cap_wait_their_turn(tiny_model):
    engine = make_llm(tiny_model, block_size=8, max_num_seqs=2).engine
    params = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
    engine.add_request("src", list(range(30, 45)), params)
    engine.step()
    for i in range(3):
        engine.fork_request("src", f"fork{i}")
    batch_sizes = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: batch_sizes.append(len(batch)) or forward(batch)
    outs = run_to_end(engine)
    assert max(batch_sizes) == 2
    assert sorted(outs) == ["fork0", "fork1", "fork2", "src"]
    assert len({tuple(o.token_ids) for o in outs.values()}) == 1
    assert_all_free(engine.kv_snapshot())


def test_parallel_samples_share_the_prompt_and_match_single_seeds(tiny_model):
    llm = make_llm(tiny_model, block_size=8)
    engine = llm.engine
    prompt = list(range(60, 100))  # five full blocks
    n, seed = 4, 321
    engine.add_request("n", prompt, SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=12, ignore_eos=True))
    peak_shared, peak_used = 0, 0
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = out if out.finished else result
        snap = engine.kv_snapshot()
        assert_invariants(snap)
        peak_used = max(peak_used, snap.num_blocks - snap.num_free_blocks)
        peak_shared = max(peak_shared, sum(1 for b in snap.blocks if b.ref_count == n))
    assert len(result.outputs) == n and peak_shared >= 5
    assert_all_free(engine.kv_snapshot())

    alone_peak = 0
    for i in range(n):
        single = SamplingParams(seed=seed + i, temperature=1.0, max_tokens=12, ignore_eos=True)
        engine.add_request(f"s{i}", prompt, single)
    singles = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                singles[out.request_id] = out
        snap = engine.kv_snapshot()
        alone_peak = max(alone_peak, snap.num_blocks - snap.num_free_blocks)
    for i in range(n):
        assert result.outputs[i].index == i
        assert result.outputs[i].token_ids == singles[f"s{i}"].token_ids
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    assert peak_used < alone_peak


def test_generate_returns_n_outputs(tiny_model):
    llm = make_llm(tiny_model)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(n=3, seed=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for o in outs for c in o.outputs)
