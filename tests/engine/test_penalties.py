"""vLLM's repetition, presence and frequency penalties: against HF's generate, a hand-written reference,
SamplingParams' validation and the server."""

from collections import Counter

import pytest
import torch
from support.engine import hf_greedy, make_llm, next_turn, random_prompts
from support.serve import GREEDY, POOL, Live
from transformers import LogitsProcessor, LogitsProcessorList

from pagedchat import SamplingParams
from pagedchat.engine.chat import ChatSession
from pagedchat.engine.core.sequence import Sequence
from pagedchat.engine.worker import sampler

# ---- repetition penalty: HF's generate, token for token ------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_repetition_penalty_equals_hf(tiny_models, arch):
    path = tiny_models[arch]
    llm = make_llm(path, block_size=8)
    prompts = random_prompts(seed=sum(map(ord, arch)) + 16, lengths=[3, 11, 24])
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, repetition_penalty=1.3, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 20, repetition_penalty=1.3)
    assert any(p.token_ids != o.token_ids for p, o in zip(plain, outs)), "the penalty changed nothing"


def test_repetition_penalty_covers_earlier_turns_like_hf(tiny_model):
    llm = make_llm(tiny_model, block_size=8)
    engine = llm.engine
    chat = ChatSession(llm.get_tokenizer())
    params = SamplingParams(max_tokens=12, repetition_penalty=1.3, **GREEDY)
    changed = False
    for message in ["Hello there!", "Tell me more, please.", "Thanks - bye."]:
        new_ids, out = next_turn(engine, chat, message, params)
        assert out.token_ids == hf_greedy(tiny_model, chat.token_ids, 12, repetition_penalty=1.3)
        # Penalising only this turn's message and reply would be a different reply somewhere.
        this_turn_only = TurnOnlyRepetitionPenalty(len(chat.token_ids) - len(new_ids), 1.3)
        changed |= out.token_ids != hf_greedy(tiny_model, chat.token_ids, 12,
                                              logits_processor=LogitsProcessorList([this_turn_only]))
        chat.add_reply(out.token_ids)
    assert changed
    engine.release_request("chat")


class TurnOnlyRepetitionPenalty(LogitsProcessor):
    """HF's repetition penalty over the tokens from `start` on only."""

    def __init__(self, start: int, penalty: float) -> None:
        self.start, self.penalty = start, penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[:, self.start:]
        score = scores.gather(1, ids)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return scores.scatter(1, ids, score)


# ---- presence and frequency: a hand-written reference ----------------------------------------------

def make_seq(token_ids: list[int], turn_start: int, **params) -> Sequence:
    seq = Sequence("s", "r", 0, list(token_ids), SamplingParams(**params), max_len=1024)
    seq.turn_start = turn_start
    return seq


def reference_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row, one token at a time: HF's repetition penalty over all tokens, then OpenAI's formula."""
    row = logits.clone()
    params = seq.params
    for token in set(seq.token_ids):
        value = row[token].item()
        row[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(seq.token_ids[seq.turn_start:]).items():
        row[token] -= count * params.frequency_penalty + params.presence_penalty
    return row


def test_penalties_equal_a_hand_written_reference():
    torch.manual_seed(3)
    vocab = 50
    logits = torch.randn(5, vocab) * 4
    seqs = [
        make_seq([1, 2, 3, 2], 2),  # neutral
        make_seq([4, 4, 5, 6, 7, 7, 7], 3, repetition_penalty=1.7),
        make_seq([8, 9, 9, 10, 10, 10, 11], 2, presence_penalty=0.5, frequency_penalty=1.25),
        make_seq([12, 13, 12, 14, 14, 12, 3], 1, repetition_penalty=0.6, presence_penalty=-1.5,
                 frequency_penalty=-0.75),
        make_seq([15, 16, 17], 3, presence_penalty=2.0, frequency_penalty=2.0),  # no output yet
    ]
    expected = torch.stack([reference_penalties(logits[i], seq) for i, seq in enumerate(seqs)])
    got = sampler.apply_penalties(logits.clone(), seqs)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got[1:4], logits[1:4]) and torch.equal(got[0], logits[0]) and torch.equal(got[4], logits[4])
    # Greedy picks the argmax of the penalised logits.
    for seq in seqs:
        seq.params.temperature = 0
    assert sampler.sample(logits.clone(), seqs, eos_token_ids=set()) == expected.argmax(dim=-1).tolist()


def test_neutral_penalties_skip_the_penalty_code(monkeypatch):
    def fail(*args):
        raise AssertionError("the neutral path must not build penalty tensors")

    monkeypatch.setattr(sampler, "apply_penalties", fail)
    seqs = [make_seq([1, 2, 2], 1, temperature=0), make_seq([3, 3], 0, temperature=0.7, seed=1)]
    assert len(sampler.sample(torch.randn(2, 20), seqs, eos_token_ids=set())) == 2


def test_min_tokens_ban_survives_a_negative_penalty():
    """A banned EOS stays banned however the penalties pull it up."""
    logits = torch.zeros(1, 10)
    logits[0, 9] = 5.0
    seq = make_seq([9, 9, 9], 0, temperature=0, min_tokens=5, presence_penalty=-2, frequency_penalty=-2,
                   repetition_penalty=0.5)
    assert sampler.sample(logits, [seq], eos_token_ids={9}) != [9]


def test_a_strong_frequency_penalty_reduces_repeats(tiny_model):
    llm = make_llm(tiny_model)
    prompts = random_prompts(seed=11, lengths=[6, 15, 30])
    plain = llm.generate(prompts, SamplingParams(max_tokens=96, ignore_eos=True, **GREEDY))
    penalised = llm.generate(prompts, SamplingParams(max_tokens=96, ignore_eos=True, frequency_penalty=2.0,
                                                     presence_penalty=1.0, **GREEDY))

    def most_repeated(out) -> int:
        return max(Counter(out.token_ids).values())

    def repeats(out) -> int:
        return len(out.token_ids) - len(set(out.token_ids))

    assert max(map(most_repeated, plain)) >= 4, "the plain replies hardly repeat: the test proves nothing"
    for p, q in zip(plain, penalised):
        assert len(q.token_ids) == len(p.token_ids) == 96
        assert repeats(q) < repeats(p) and most_repeated(q) <= most_repeated(p)


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5), ("frequency_penalty", float("nan")),
])
def test_bad_penalties_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_edge_penalties_pass():
    params = SamplingParams(repetition_penalty=0.01, presence_penalty=-2, frequency_penalty=2)
    assert params.penalised and not SamplingParams().penalised


# ---- the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(tiny_model):
    server = Live(tiny_model)
    yield server
    server.stop()


def test_server_honours_repetition_penalty(live, tiny_model):
    reference = make_llm(tiny_model, **POOL)
    prompt = random_prompts(seed=23, lengths=[14])[0]
    params = dict(max_tokens=16, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    expected = reference.generate([prompt], SamplingParams(**params, **GREEDY))[0]
    plain = reference.generate([prompt], SamplingParams(max_tokens=16, **GREEDY))[0]
    assert expected.token_ids != plain.token_ids
    out = live.http.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "return_token_ids": True,
                                                   **params})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == expected.token_ids
    chat = live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0, frequency_penalty=1.0,
                                               extra_body={"repetition_penalty": 1.2})
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("field, value", [("presence_penalty", 3), ("frequency_penalty", -2.5),
                                          ("repetition_penalty", 0)])
def test_server_refuses_out_of_range_penalties(live, field, value):
    out = live.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, field: value})
    assert out.status_code == 400
    error = out.json()["error"]
    assert error["code"] == 400 and field in error["message"]
