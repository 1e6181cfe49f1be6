"""The engine on the Triton kernels (under TRITON_INTERPRET=1 on the CPU) against HF generate."""

import os

from test_engine import GREEDY, hf_greedy, make_llm, random_prompts

from pagedchat import SamplingParams


def test_triton_backend_matches_hf(tiny_model):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    llm = make_llm(tiny_model, attention_backend="triton", block_size=8, num_kv_blocks=32, max_num_batched_tokens=32)
    prompts = random_prompts(seed=11, lengths=[1, 8, 13, 40])
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, 6, min_new_tokens=6)
