"""Shared by the tests of several modules."""

import random
from functools import cache

import torch
from transformers import AutoModelForCausalLM

from pagedchat import LLM
from pagedchat.engine.core.invariants import assert_invariants

GREEDY = dict(temperature=0.0)


@cache
def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, token_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    out = hf_model(path).generate(
        torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, **kwargs,
    )
    return out[0, len(token_ids):].tolist()


def make_llm(path, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "device": "cpu", "attention_backend": "torch", **kwargs}
    return LLM(model=path, **kwargs)


def run_to_end(engine, check=True, max_steps: int = 5000) -> dict[str, object]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check:
            assert_invariants(engine.kv_snapshot())
    else:
        raise AssertionError(f"the requests did not finish in {max_steps} steps")
    return finished


def next_turn(engine, chat, message: str, params, request_id: str = "chat") -> tuple[list[int], object]:
    """The chat's next user message sent (the whole prompt on its first turn, after that only the new
    tokens of a kept request) and run to its end: the tokens sent, and the turn's output."""
    first = not chat.token_ids
    new_ids = chat.user_turn(message)
    if first:
        engine.add_request(request_id, new_ids, params, keep=True)
    else:
        engine.continue_request(request_id, new_ids, params)
    return new_ids, run_to_end(engine)[request_id]


def random_prompts(seed: int, lengths: list[int], vocab: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
