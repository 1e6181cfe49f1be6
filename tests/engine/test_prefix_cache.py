"""A prefix-cache hit is the same tokens at the same place in the same chain, never a hash match alone."""

import pytest
from support.engine import GREEDY, hf_greedy, make_llm, random_prompts, run_to_end

from pagedchat import SamplingParams
from pagedchat.engine.core import kv_manager
from pagedchat.engine.core.block_pool import chain_hash
from pagedchat.engine.core.invariants import assert_all_free

BS = 4


def scenario() -> tuple[list[list[int]], int]:
    """Prompts run one after another, and the tokens the prefix cache must serve them (by hand)."""
    a, b, c, x, b2 = random_prompts(seed=11, lengths=[BS] * 5)
    tail = [7, 8, 9]
    prompts = [
        a + b + tail,          # nothing cached yet
        a + b + tail,          # a and b again: 2 blocks
        c + b + tail,          # b after another first block is other KV: nothing
        x + x + x + x + tail,  # one block repeated: each repeat sits at another place in the chain
        x + x + x + x + tail,  # all 4 blocks
        a + b2 + tail,         # a, then a block never seen: 1 block
    ]
    return prompts, BS * (2 + 0 + 0 + 0 + 4 + 1)


@pytest.mark.parametrize("colliding", [False, True], ids=["real hash", "every block collides"])
def test_hits_are_true_hits_even_when_every_hash_collides(tiny_model, monkeypatch, colliding):
    if colliding:
        monkeypatch.setattr(kv_manager, "chain_hash", lambda parent, token_ids: 0)
    engine = make_llm(tiny_model, block_size=BS, num_kv_blocks=64).engine
    prompts, expected_hits = scenario()
    params = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
    for number, prompt in enumerate(prompts):
        engine.add_request(f"r{number}", prompt, params)
        out = run_to_end(engine)[f"r{number}"]
        assert out.token_ids == hf_greedy(tiny_model, prompt, 6, min_new_tokens=6), f"prompt {number}"
    snap = engine.kv_snapshot()
    assert snap.prefix_cache_hits == expected_hits
    assert snap.prefix_cache_queries == sum(map(len, prompts))
    if colliding:
        assert {b.block_hash for b in snap.blocks if b.cached} == {0}
    assert_all_free(snap)


def test_a_first_block_never_hashes_like_a_child():
    tokens = (1, 2, 3, 4)
    assert chain_hash(None, tokens) != chain_hash(-1, tokens)
    assert chain_hash(None, tokens) != chain_hash(-2, tokens)  # hash(-1) == hash(-2) in CPython
    assert chain_hash(chain_hash(None, tokens), tokens) != chain_hash(None, tokens)
