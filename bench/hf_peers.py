"""The peers pagedchat is measured against, all stock transformers, run on the same requests.

- `hf_static`: `model.generate` on static batches (left-padded, in arrival order): a batch runs until
  its longest output is done, which is the waste continuous batching removes.
- the same with `attn_implementation=FOLDED_SDPA`: transformers' SDPA integration passes
  `enable_gqa=True` when there is no mask, slow on the CPU; this variant always folds each KV head's
  query heads into the query-length dimension for decode (what transformers itself does for masked
  decode) and repeats K/V for prompts. It is the fair baseline: the same maths, no slow path.
- `hf_continuous`: transformers' own continuous batching (`generate_batch`'s manager), same page
  size, `num_blocks` set (it would size its cache from host RAM otherwise).

Each returns its wall and CPU times; requests generate exactly `output_len` tokens (EOS ignored).
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, GenerationConfig

from bench.common import Request, Times, stopwatch

FOLDED_SDPA = "sdpa_folded_gqa"


def folded_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """query [B, H, T, D], key/value [B, KVH, L, D] -> ([B, T, H, D], None), never with enable_gqa."""
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if q_len == 1:
        # [B, H, 1, D] -> [B, KVH, G, D]: the group's query heads become query rows of one KV head
        q = query.reshape(batch, key.shape[1], groups, dim)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(batch, heads, 1, dim).transpose(1, 2), None
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    causal = attention_mask is None and q_len > 1
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling)
    return out.transpose(1, 2), None


AttentionInterface.register(FOLDED_SDPA, folded_sdpa_forward)


@torch.inference_mode()
def hf_static(model, requests: Sequence[Request], batch_size: int = 8, pad_token_id: int = 0) -> Times:
    with stopwatch() as t:
        _static_batches(model, requests, batch_size, pad_token_id)
    return t


def _static_batches(model, requests: Sequence[Request], batch_size: int, pad_token_id: int) -> None:
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt) for r in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(r.prompt)) + r.prompt for r in batch])
        attention_mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new = max(r.output_len for r in batch)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_token_id)
        assert out.shape[1] == width + new


def hf_single(model, prompt: list[int], max_new_tokens: int = 1) -> Times:
    """One unpadded `generate` call (the model recomputes the whole prompt)."""
    with torch.inference_mode(), stopwatch() as t:
        model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                       do_sample=False, pad_token_id=0)
    return t


def hf_continuous(model, requests: Sequence[Request], num_blocks: int, page_size: int = 16,
                  max_batch_tokens: int = 1024, max_requests: int = 64) -> Times:
    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_requests, allow_block_sharing=False)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests), eos_token_id=-1)
    with model.continuous_batching_context_manager(generation_config=generation, continuous_batching_config=config,
                                                   block=True, timeout=5) as manager:
        with stopwatch() as t:  # from here: its cache is allocated and warmed up, as the engine's is
            _serve(manager, requests)
    return t


def _serve(manager, requests: Sequence[Request]) -> None:
    ids = [manager.add_request(r.prompt, max_new_tokens=r.output_len, eos_token_id=-1) for r in requests]
    expected = {i: r.output_len for i, r in zip(ids, requests)}
    done = 0
    while done < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"generate_batch failed: {result.error}")
            assert len(result.generated_tokens) == expected[result.request_id], "wrong output length"
            done += 1
