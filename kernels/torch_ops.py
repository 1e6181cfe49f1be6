"""Paged KV store and paged attention in plain, vectorised torch: the CPU backend of the engine.

Same signatures as `triton_ops`. Sequences are grouped by the shape of their work, and each group
is one padded batch for `scaled_dot_product_attention`:

- decode rows (one query) and chunked rows (queries after a cached prefix) attend through an
  explicit causal mask; each KV head's group of query heads is folded into the query-length
  dimension, so K/V are read once per KV head (SDPA's `enable_gqa` and `repeat_interleave` of K/V
  are both several times slower on the CPU in bf16);
- whole prompts (queries = the whole context) take SDPA's causal kernel, which skips the masked
  half of the work; it cannot fold heads (its causality follows the row index), so K/V are
  repeated per query head instead, a copy that is small next to the attention of a whole prompt.

Every layer of a model step passes the same block tables, lengths and query starts, so the index
work (grouping, row and block indices, masks) is planned once per step and reused by all layers.
K/V are gathered whole blocks at a time; the slots past a sequence's length that come along are
zeroed, since whatever an unused slot holds (maybe NaN) would survive a mask: 0 * NaN = NaN.
SDPA keeps the softmax in fp32 for half-precision inputs.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # view (not reshape): a cache that cannot be viewed flat must fail, not be written as a copy
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len positions) over its paged context.

    num_kv_splits is accepted for parity with the Triton kernel; this implementation never splits.
    """
    if out is None:
        out = query.new_empty(query.shape)  # contiguous, whatever the layout of query
    group_size = query.shape[1] // key_cache.shape[2]
    for plan in _plan(block_tables, seq_lens, query_start_loc, key_cache.shape[1], group_size):
        _attend(plan, query, key_cache, value_cache, scale, out)
    return out


@dataclass(slots=True, frozen=True)
class _GroupPlan:
    """One padded SDPA batch: `num_seqs` sequences of up to `max_q` queries over up to `max_len` keys."""
    num_seqs: int
    max_q: int
    max_len: int
    rows: torch.Tensor  # [S * max_q] query row of each padded query (a sequence's last row repeated)
    real_rows: torch.Tensor | None  # [S * max_q] bool, None when no query is padding
    blocks: torch.Tensor  # [S * max_len / block_size] the blocks to gather, in order
    past_end: torch.Tensor  # gathered slots past their sequence's length
    mask: torch.Tensor | None  # [S, 1, max_q * G, max_len] bool; None: causal over the whole prompt


_last_plan: tuple[tuple, list[_GroupPlan]] | None = None


def _plan(block_tables, seq_lens, query_start_loc, block_size: int, group_size: int) -> list[_GroupPlan]:
    """The plan of the last call when its inputs are equal (the next layer of the same step), else a new one.

    Inputs are compared by value against copies: inference tensors have no version counter to tell
    an in-place change, and a new step's tensors may reuse the memory of the last one's.
    """
    global _last_plan
    inputs = (block_tables, seq_lens, query_start_loc)
    if _last_plan is not None:
        (last_inputs, last_sizes), plans = _last_plan
        if last_sizes == (block_size, group_size) and all(
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
                for a, b in zip(inputs, last_inputs)):
            return plans
    plans = _make_plan(*inputs, block_size, group_size)
    _last_plan = (tuple(t.clone() for t in inputs), (block_size, group_size)), plans
    return plans


def _make_plan(block_tables, seq_lens, query_start_loc, block_size: int, group_size: int) -> list[_GroupPlan]:
    seq_lens = seq_lens.long()
    query_start_loc = query_start_loc.long()
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    decode = q_lens == 1
    whole_prompt = ~decode & (q_lens == seq_lens)
    chunked = ~decode & ~whole_prompt
    plans = []
    for group, causal in ((decode, False), (whole_prompt, True), (chunked, False)):
        seqs = group.nonzero().flatten()
        if len(seqs):
            plans.append(_plan_group(block_tables[seqs], seq_lens[seqs], query_start_loc[seqs],
                                     q_lens[seqs], block_size, group_size, causal))
    return plans


def _plan_group(block_tables, seq_lens, q_starts, q_lens, block_size, group_size, causal) -> _GroupPlan:
    device = seq_lens.device
    num_seqs = len(seq_lens)
    max_q = int(q_lens.max())
    num_blocks = -(-int(seq_lens.max()) // block_size)
    max_len = num_blocks * block_size

    q_offsets = torch.arange(max_q, device=device)
    real_q = q_offsets < q_lens[:, None]
    rows = q_starts[:, None] + torch.minimum(q_offsets, q_lens[:, None] - 1)
    key_positions = torch.arange(max_len, device=device)
    past_end = (key_positions >= seq_lens[:, None]).flatten().nonzero().flatten()
    # table entries past a sequence's own blocks may hold anything (padding, -1): read block 0
    own = torch.arange(num_blocks, device=device) * block_size < seq_lens[:, None]
    blocks = torch.where(own, block_tables[:, :num_blocks].long(), 0)
    mask = None
    if not causal:
        positions = seq_lens[:, None] - q_lens[:, None] + q_offsets  # [S, max_q]
        mask = key_positions <= positions[:, :, None]  # [S, max_q, L]
        mask = mask.repeat_interleave(group_size, dim=1)[:, None]  # [S, 1, max_q * G, L]
    return _GroupPlan(num_seqs, max_q, max_len, rows.flatten(), None if bool(real_q.all()) else real_q.flatten(),
                      blocks.flatten(), past_end, mask)


def _attend(plan: _GroupPlan, query, key_cache, value_cache, scale, out) -> None:
    """One padded SDPA batch for a group of sequences; writes their rows of `out`."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    s, max_q = plan.num_seqs, plan.max_q

    q = query.index_select(0, plan.rows).view(s, max_q, num_q_heads, head_dim)
    key = _gather(key_cache, plan)
    value = _gather(value_cache, plan)

    if plan.mask is None:  # queries are the whole context: row j is position j
        key = _repeat_heads(key, group_size).transpose(1, 2)
        value = _repeat_heads(value, group_size).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), key, value, is_causal=True, scale=scale)
        o = o.transpose(1, 2)  # [S, max_q, Hq, D]
    else:
        # fold: [S, max_q, Hkv, G, D] -> [S, Hkv, max_q * G, D], rows ordered (query, head in group)
        q = q.view(s, max_q, num_kv_heads, group_size, head_dim).permute(0, 2, 1, 3, 4)
        q = q.reshape(s, num_kv_heads, max_q * group_size, head_dim)
        o = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                           attn_mask=plan.mask, scale=scale)
        o = o.view(s, num_kv_heads, max_q, group_size, head_dim).permute(0, 2, 1, 3, 4)
        o = o.reshape(s, max_q, num_q_heads, head_dim)

    o = o.flatten(0, 1)
    if plan.real_rows is None:
        out.index_copy_(0, plan.rows, o.to(out.dtype))
    else:
        out.index_copy_(0, plan.rows[plan.real_rows], o[plan.real_rows].to(out.dtype))


def _gather(cache: torch.Tensor, plan: _GroupPlan) -> torch.Tensor:
    """[S, max_len, Hkv, D]: each sequence's context in order, zeros past its length."""
    slots = cache.index_select(0, plan.blocks).flatten(0, 1)
    slots.index_fill_(0, plan.past_end, 0)
    return slots.view(plan.num_seqs, plan.max_len, *cache.shape[2:])


def _repeat_heads(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[S, L, Hkv, D] -> [S, L, Hkv * G, D], each KV head repeated for its group of query heads."""
    s, length, heads, dim = x.shape
    return x[:, :, :, None].expand(s, length, heads, group_size, dim).reshape(s, length, -1, dim)
