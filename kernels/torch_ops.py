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

SDPA keeps the softmax in fp32 for half-precision inputs. Slots past a sequence's length are
gathered from its first slot rather than from whatever an unused block holds (maybe NaN, which a
mask alone would not cancel: 0 * NaN = NaN), then masked out.
"""

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
    seq_lens = seq_lens.long()
    query_start_loc = query_start_loc.long()
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    decode = q_lens == 1
    whole_prompt = ~decode & (q_lens == seq_lens)
    chunked = ~decode & ~whole_prompt
    for group, causal in ((decode, False), (whole_prompt, True), (chunked, False)):
        seqs = group.nonzero().flatten()
        if len(seqs):
            _attend_group(query, key_cache, value_cache, block_tables[seqs], seq_lens[seqs],
                          query_start_loc[seqs], q_lens[seqs], scale, out, causal)
    return out


def _attend_group(query, key_cache, value_cache, block_tables, seq_lens, q_starts, q_lens, scale,
                  out, causal: bool) -> None:
    """One padded SDPA batch for a group of sequences; writes their rows of `out`."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    num_seqs = len(seq_lens)
    max_q, max_len = int(q_lens.max()), int(seq_lens.max())

    # query rows, left-aligned and padded with copies of each sequence's last row
    q_offsets = torch.arange(max_q, device=query.device)
    real_q = q_offsets < q_lens[:, None]
    rows = q_starts[:, None] + torch.minimum(q_offsets, q_lens[:, None] - 1)
    q = query.index_select(0, rows.flatten()).view(num_seqs, max_q, num_q_heads, head_dim)

    key = _gather_context(key_cache, block_tables, seq_lens, max_len)
    value = _gather_context(value_cache, block_tables, seq_lens, max_len)

    if causal:  # queries are the whole context: row j is position j
        key = _repeat_heads(key, group_size).transpose(1, 2)
        value = _repeat_heads(value, group_size).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), key, value, is_causal=True, scale=scale)
        o = o.transpose(1, 2)  # [S, max_q, Hq, D]
    else:
        # fold: [S, max_q, Hkv, G, D] -> [S, Hkv, max_q * G, D], rows ordered (query, head in group)
        q = q.view(num_seqs, max_q, num_kv_heads, group_size, head_dim).permute(0, 2, 1, 3, 4)
        q = q.reshape(num_seqs, num_kv_heads, max_q * group_size, head_dim)
        positions = seq_lens[:, None] - q_lens[:, None] + q_offsets  # [S, max_q]
        key_positions = torch.arange(max_len, device=query.device)
        mask = key_positions <= positions[:, :, None]  # [S, max_q, L]
        mask = mask.repeat_interleave(group_size, dim=1)[:, None]  # [S, 1, max_q * G, L]
        o = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                           attn_mask=mask, scale=scale)
        o = o.view(num_seqs, num_kv_heads, max_q, group_size, head_dim).permute(0, 2, 1, 3, 4)
        o = o.reshape(num_seqs, max_q, num_q_heads, head_dim)

    if max_q == 1:
        out.index_copy_(0, rows.flatten(), o.flatten(0, 1).to(out.dtype))
    else:
        out.index_copy_(0, rows[real_q], o[real_q].to(out.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    max_len: int) -> torch.Tensor:
    """[S, max_len, Hkv, D]: each sequence's context in order; slots past its length hold slot 0's data."""
    block_size = cache.shape[1]
    positions = torch.arange(max_len, device=cache.device)
    blocks = block_tables[:, positions // block_size].long()
    slots = blocks * block_size + positions % block_size
    slots = torch.where(positions < seq_lens[:, None], slots, slots[:, :1])
    flat = cache.view(-1, *cache.shape[2:])
    return flat.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[2:])


def _repeat_heads(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[S, L, Hkv, D] -> [S, L, Hkv * G, D], each KV head repeated for its group of query heads."""
    s, length, heads, dim = x.shape
    return x[:, :, :, None].expand(s, length, heads, group_size, dim).reshape(s, length, -1, dim)
