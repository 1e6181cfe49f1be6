"""The real default model (SmolLM2-135M-Instruct from its GGUF), end to end: one short chat."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedchat import LLM, SamplingParams
from pagedchat.engine.chat import ChatSession


@pytest.fixture(scope="module")
def default_llm():
    return LLM(dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=64)


@pytest.mark.slow
def test_short_chat_matches_hf_generate(default_llm):
    chat = ChatSession(default_llm.get_tokenizer())
    engine = default_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24)
    reference = AutoModelForCausalLM.from_pretrained(default_llm.model_path, dtype=torch.float32).eval()
    for turn, message in enumerate(["What is the capital of France?", "And of Italy?"]):
        ids = chat.user_turn(message)
        if turn == 0:
            engine.add_request("chat", ids, params, keep=True)
        else:
            engine.continue_request("chat", ids, params)
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.finished), out)
        expected = reference.generate(torch.tensor([chat.token_ids]), max_new_tokens=24, do_sample=False)
        assert out.token_ids == expected[0, len(chat.token_ids):].tolist()
        chat.add_reply(out.token_ids)
    assert "Paris" in chat.messages[1]["content"]
