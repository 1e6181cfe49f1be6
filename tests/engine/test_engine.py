"""The engine against Hugging Face `generate` (fp32, greedy), with the pool's invariants after every step."""


import pytest
import torch
from support.engine import GREEDY, hf_greedy, make_llm, next_turn, random_prompts, run_to_end

from pagedchat import SamplingParams
from pagedchat.engine.chat import ChatSession
from pagedchat.engine.core.invariants import assert_all_free, assert_invariants


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_concurrent_greedy_matches_hf_under_pressure(tiny_models, arch):
    """Ten prompts (1 token to several blocks, some ending on a block boundary, two sharing a prefix)
    through a pool too small for all of them and a token budget that chunks every long prompt."""
    path = tiny_models[arch]
    llm = make_llm(path, block_size=8, num_kv_blocks=28, max_num_batched_tokens=24, max_model_len=224)
    engine = llm.engine
    first, *rest = random_prompts(seed=sum(map(ord, arch)), lengths=[40, 1, 7, 8, 16, 33, 50, 64, 3])
    rest = [first[:32] + [5, 6], first[:16] + [7]] + rest
    params = SamplingParams(max_tokens=24, min_tokens=24, **GREEDY)
    engine.add_request("first", first, params)
    while engine.kv_snapshot().requests[0].num_computed_tokens < len(first):
        engine.step()
    for i, prompt in enumerate(rest):
        engine.add_request(f"r{i}", prompt, params)
    finished = run_to_end(engine)
    snap = engine.kv_snapshot()
    assert snap.num_preemptions > 0, "the pool was meant to run dry"
    assert snap.prefix_cache_hits >= 32, "the shared prefixes were meant to come from the cache"
    assert_all_free(snap)
    for request_id, prompt in [("first", first)] + [(f"r{i}", p) for i, p in enumerate(rest)]:
        assert finished[request_id].token_ids == hf_greedy(path, prompt, 24, min_new_tokens=24), request_id
        assert finished[request_id].finish_reason == "length"


def test_stops_at_eos_like_hf(tiny_model):
    llm = make_llm(tiny_model)
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(seed=7, lengths=[5, 12, 30, 2, 9, 17, 4, 21])
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    assert any(o.finish_reason == "stop" for o in outs), "no prompt reached EOS: the test proves nothing"
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(tiny_model, prompt, 40)
        assert out.token_ids == expected
        assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")


def test_three_turn_conversation_computes_only_new_tokens(tiny_model):
    llm = make_llm(tiny_model, block_size=8)
    engine = llm.engine
    chat = ChatSession(llm.get_tokenizer())
    params = SamplingParams(max_tokens=12, **GREEDY)
    for message in ["Hello there!", "Tell me more, please.", "Thanks — bye."]:
        resident = chat.num_tokens
        _, out = next_turn(engine, chat, message, params)
        # Everything from earlier turns was resident except the last reply token, whose KV is computed now.
        assert out.num_cached_tokens == max(resident - 1, 0)
        assert out.prompt_token_ids == chat.token_ids
        assert out.token_ids == hf_greedy(tiny_model, chat.token_ids, 12)
        chat.add_reply(out.token_ids)
        assert engine.kv_snapshot().requests[0].status == "parked"
    engine.release_request("chat")
    assert_all_free(engine.kv_snapshot())


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_released_conversation_continues_with_same_tokens(tiny_model, prefix_caching):
    llm = make_llm(tiny_model, block_size=8, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    chat = ChatSession(llm.get_tokenizer(), system_prompt="Be brief.")
    params = SamplingParams(max_tokens=10, **GREEDY)
    engine.add_request("c", chat.user_turn("First question?"), params, keep=True)
    chat.add_reply(run_to_end(engine)["c"].token_ids)
    engine.release_request("c")
    assert_all_free(engine.kv_snapshot())
    engine.continue_request("c", chat.user_turn("Second question?"), params)
    out = run_to_end(engine)["c"]
    assert out.token_ids == hf_greedy(tiny_model, chat.token_ids, 10)
    block_size = 8
    expected_cached = (len(chat.token_ids) - 1) // block_size * block_size if prefix_caching else 0
    assert out.num_cached_tokens <= expected_cached
    assert (out.num_cached_tokens > 0) == prefix_caching


def test_abort_frees_or_parks(tiny_model):
    engine = make_llm(tiny_model, block_size=8).engine
    params = SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY)
    engine.add_request("free", [1, 2, 3, 4, 5], params)
    engine.add_request("keep", [1, 2, 3, 4, 6], params, keep=True)
    for _ in range(3):
        engine.step()
    engine.abort_request("free")
    engine.abort_request("keep")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["free"].finish_reason == outs["keep"].finish_reason == "abort"
    assert len(outs["keep"].token_ids) >= 2
    snap = engine.kv_snapshot()
    assert_invariants(snap)
    assert snap.block_tables["keep"] and "free" not in snap.block_tables
    assert {r.request_id: r.status for r in snap.requests} == {"keep": "parked"}  # "free" is forgotten
    assert any(e.kind == "free" and e.request_id == "free" for e in snap.events)
    engine.add_request("free", [7, 8], params)  # its id is free again
    engine.abort_request("free")
    engine.step()
    assert not engine.has_unfinished_requests()
    engine.release_request("keep")
    assert_all_free(engine.kv_snapshot())


def test_parked_conversations_are_released_least_recently_used_before_any_preemption(tiny_model):
    """Three parked conversations fill most of a 16-block pool; a new request that needs more than
    the free blocks, first for its prompt and then as it grows, takes the parked ones' blocks in
    least-recently-used order (not the order they were created in) and preempts nothing."""
    llm = make_llm(tiny_model, block_size=4, num_kv_blocks=16, max_model_len=64)
    engine = llm.engine
    short = SamplingParams(max_tokens=2, ignore_eos=True, **GREEDY)
    for i, request_id in enumerate("abc"):
        engine.add_request(request_id, [10 * i + k for k in range(10)], short, keep=True)
    run_to_end(engine)
    engine.continue_request("a", [99], SamplingParams(max_tokens=1, ignore_eos=True, **GREEDY))
    run_to_end(engine)  # "a" is now the most recently used; "b" the least
    snap = engine.kv_snapshot()
    parked = {r.request_id: r.block_table for r in snap.requests if r.status == "parked"}
    assert sorted(parked) == ["a", "b", "c"] and all(parked.values())
    held = sum(len(table) for table in parked.values())
    assert snap.num_free_blocks == 16 - held
    prompt = list(range(100, 130))  # 8 blocks: more than the free ones
    assert len(prompt) // 4 > snap.num_free_blocks
    blocks_at_end = -(-(len(prompt) + 20 - 1) // 4)  # the last sampled token is never computed
    assert blocks_at_end > 16 - len(parked["a"]), "the request must need all three conversations' blocks"
    since = snap.events[-1].seq
    engine.add_request("d", prompt, SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY))
    out = run_to_end(engine)["d"]
    snap = engine.kv_snapshot()
    reclaims = [(e.kind, e.request_id) for e in snap.events if e.seq > since and e.kind in ("release", "preempt")]
    assert reclaims == [("release", "b"), ("release", "c"), ("release", "a")]
    assert snap.num_preemptions == 0
    assert out.token_ids == hf_greedy(tiny_model, prompt, 20, min_new_tokens=20)
    infos = {r.request_id: r for r in snap.requests if r.request_id in parked}
    assert {rid: (info.status, info.block_table) for rid, info in infos.items()} == {
        rid: ("parked", ()) for rid in "abc"}  # released, still continuable
    assert_all_free(snap)


def test_prompt_that_cannot_fit_fails_alone(tiny_model):
    llm = make_llm(tiny_model, block_size=8, num_kv_blocks=8)
    outs = llm.generate([[3] * 100, [4, 5, 6]], SamplingParams(max_tokens=5, **GREEDY))
    assert outs[0].finish_reason == "error" and "context" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 5


def test_malformed_arguments_raise(tiny_model):
    engine = make_llm(tiny_model).engine
    with pytest.raises(ValueError):
        SamplingParams(n=0)
    with pytest.raises(ValueError):
        engine.abort_request("nope")
    engine.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError):
        engine.continue_request("a", [3], SamplingParams())


def test_engine_error_fails_the_batch_and_serves_the_rest(tiny_model, monkeypatch):
    engine = make_llm(tiny_model).engine
    params = SamplingParams(max_tokens=6, **GREEDY)
    engine.add_request("doomed", [1, 2, 3], params)
    real_forward = engine.runner.forward

    def exploding(batch):
        monkeypatch.setattr(engine.runner, "forward", real_forward)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "forward", exploding)
    outs = engine.step()
    assert outs[0].finish_reason == "error" and "injected fault" in outs[0].error
    assert_all_free(engine.kv_snapshot())
    engine.add_request("fine", [1, 2, 3], params)
    assert run_to_end(engine)["fine"].token_ids == hf_greedy(tiny_model, [1, 2, 3], 6)


def test_streamed_text_never_splits_a_character(tiny_model):
    """The byte-level tiny tokenizer spells 'é' with two tokens: no step may show half of it."""
    llm = make_llm(tiny_model)
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    forced = tokenizer.encode("héllo wörld ✓", add_special_tokens=False)
    assert len(forced) > len("héllo wörld ✓")
    # Feed the text's own tokens as stop-free output by making them the only allowed continuation.
    pieces = []
    engine.add_request("s", [1, 2, 3], SamplingParams(max_tokens=len(forced), ignore_eos=True, **GREEDY))
    original = engine.runner.forward

    def forcing(batch):
        logits = torch.full_like(original(batch), -1e9)
        logits[:, forced[min(len(pieces), len(forced) - 1)]] = 0
        return logits

    engine.runner.forward = forcing
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].new_text)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == "héllo wörld ✓"


def test_sampling_is_seeded_and_filtered(tiny_model):
    llm = make_llm(tiny_model)
    prompt = [10, 20, 30]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    a, b = llm.generate([prompt, prompt], [seeded, seeded])
    assert a.token_ids == b.token_ids
    other = llm.generate(prompt, SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True))[0]
    assert other.token_ids != a.token_ids
    top1 = llm.generate(prompt, SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=15, ignore_eos=True))[0]
    assert top1.token_ids == hf_greedy(tiny_model, prompt, 15, min_new_tokens=15)
    tiny_p = llm.generate(prompt, SamplingParams(temperature=0.8, top_p=1e-6, seed=5, max_tokens=15, ignore_eos=True))[0]
    assert tiny_p.token_ids == top1.token_ids


def test_stop_conditions(tiny_model):
    llm = make_llm(tiny_model)
    prompt = [40, 41, 42]
    free_run = llm.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY))[0]
    assert len(free_run.token_ids) == 30 and free_run.finish_reason == "length"
    stop_id = free_run.token_ids[5]
    by_id = llm.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id], **GREEDY))[0]
    cut = free_run.token_ids.index(stop_id) + 1
    assert by_id.token_ids == free_run.token_ids[:cut] and by_id.finish_reason == "stop"
    stop_text = free_run.text[8:10]
    by_text = llm.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop_text], **GREEDY))[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == free_run.text[: free_run.text.index(stop_text)]


def test_min_tokens_holds_back_an_early_eos(tiny_model):
    """A prompt whose greedy reply ends at EOS within a few tokens, then the same prompt with
    min_tokens past that point: EOS is held back until min_tokens are out."""
    llm = make_llm(tiny_model)
    eos = llm.get_tokenizer().eos_token_id
    candidates = [[i] for i in range(256)]  # every one-byte prompt; the first that stops early is used
    free_runs = llm.generate(candidates, SamplingParams(max_tokens=10, **GREEDY))
    early = [(prompt, out) for prompt, out in zip(candidates, free_runs) if out.finish_reason == "stop"]
    assert early, "no one-byte prompt reaches EOS within 10 tokens: the test would prove nothing"
    prompt, free_run = early[0]
    assert free_run.token_ids[-1] == eos and len(free_run.token_ids) < 10
    min_tokens = len(free_run.token_ids) + 5
    held = llm.generate(prompt, SamplingParams(max_tokens=30, min_tokens=min_tokens, **GREEDY))[0]
    assert len(held.token_ids) >= min_tokens and eos not in held.token_ids[:min_tokens]
    # Greedy up to where EOS was, then the best token other than EOS, as HF's min_new_tokens does.
    assert held.token_ids[: len(free_run.token_ids) - 1] == free_run.token_ids[:-1]
    assert held.token_ids == hf_greedy(tiny_model, prompt, 30, min_new_tokens=min_tokens)


def test_chat_api(tiny_model):
    llm = make_llm(tiny_model)
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8, **GREEDY))[0]
    chat = ChatSession(llm.get_tokenizer())
    ids = chat.user_turn("Hi")
    assert out.prompt_token_ids == ids
    assert out.token_ids == hf_greedy(tiny_model, ids, 8)
