"""Paged KV store and paged attention in plain, vectorised torch: the CPU backend of the engine.

Same signatures as `triton_ops`. A step is planned once, from the host-side lists of its
`AttentionMetadata`, and the plan serves every layer. On a CPU each torch call costs microseconds
whatever its size, so the plan keeps the calls per layer few:

- a whole prompt (queries = the whole context) attends to its own new K/V with SDPA's causal kernel,
  which skips the masked half of the work; nothing is read back from the cache (the K/V are taken as the
  cache holds them, though: rounded to its dtype, or quantized and back in an 8-bit cache, so that a prompt
  sees what a later step reading the cache sees);
- a lone sequence over a cached context (one chat decoding, or one prompt chunk) reads its K/V as a
  view of the cache when its blocks are consecutive (else one gather of its blocks), cut to its
  length, so no mask and no padding are needed;
- where cpu_attention.c is built (AVX2), every sequence with a single query (a chat decoding) is attended
  there, all in one call, reading its K/V in place through its block table: no gather, no padding (a bf16
  cache on a CPU with avx512_bf16: cpu_attention_bf16.c, the same call);
- several such sequences otherwise form one padded SDPA batch, gathered whole blocks at a time, with an explicit
  mask; the slots past each length that come along are zeroed, since whatever an unused slot holds
  (maybe NaN) would survive a mask: 0 * NaN = NaN.

Over the cache, each KV head's group of query heads is folded into the query-length dimension, so K/V
are read once per KV head (SDPA's `enable_gqa` and `repeat_interleave` of K/V are both several times
slower on the CPU in bf16). SDPA keeps the softmax in fp32 for half-precision inputs.

The cache's dtype may differ from the queries' (an fp32 model over a bf16 cache, or an 8-bit cache: see
kv_quant.py): K/V are stored in the cache's format and read back as the queries' dtype, by cpu_attention.c
in place, or here by `kv_quant.dequantize` after a gather.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from . import cpu_attention, kv_quant
from .metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are skipped."""
    kv_quant.store(key, value, key_cache, value_cache, slot_mapping)


def _store_every_slot(key, value, key_cache, value_cache, slot_mapping) -> None:
    """`store_kv` for the engine's steps, where every token has its slot: one copy per cache, no mask."""
    flat = (-1, *key_cache.shape[2:])
    key_cache.view(flat).index_copy_(0, slot_mapping, kv_quant.quantize(key, key_cache.dtype))
    value_cache.view(flat).index_copy_(0, slot_mapping, kv_quant.quantize(value, value_cache.dtype))


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer's attention for a step: store the new K/V [T, Hkv, D], then attend query [T, Hq, D]."""
    out = query.new_empty(query.shape)
    step = decode_step(query, key, value, out, key_cache, value_cache, metadata, scale)
    if step is not None:  # a step of decodes only: cpu_attention.c stores the new K/V too, in the same pass
        step(key_cache, value_cache)
        return out
    _store_every_slot(key, value, key_cache, value_cache, metadata.slot_mapping)
    _run(_plan(query, key_cache, value_cache, metadata), query, key, value, key_cache, value_cache, scale, out)
    return out


def decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
                ) -> cpu_attention.DecodeStep | None:
    """`attention` for every layer of a step of decodes only that cpu_attention.c attends in place: bound to
    query/key/value (read) and out (written) where they lie, called with each layer's caches (like these). None
    for any other step."""
    plan = _plan(query, key_cache, value_cache, metadata)
    if len(plan) == 1 and isinstance(plan[0], _Decode) and _rows_of_heads(query, key, value):
        part = plan[0]
        return cpu_attention.DecodeStep(query, part.rows, key_cache, part.block_tables, part.seq_lens, scale, out,
                                        (key, value, metadata.slot_mapping))
    return None


def _plan(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
          ) -> list:
    """The step's plan, made by its first layer for all (metadata.plan)."""
    if metadata.plan is None:
        metadata.plan = _make_plan(metadata.block_tables_host, metadata.seq_lens_host, metadata.query_lens_host,
                                   key_cache.shape[1], query.shape[1] // key_cache.shape[2], query.device,
                                   fresh_prompts=True,
                                   in_place_decode=cpu_attention.takes(query, key_cache, value_cache))
    return metadata.plan


def _rows_of_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    head_dim = key.shape[-1]
    return key.dtype == value.dtype == query.dtype and key.stride()[1:] == value.stride()[1:] == (head_dim, 1)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len positions) over its paged context.

    num_kv_splits is accepted for parity with the Triton kernel; this implementation never splits.
    """
    if out is None:
        out = query.new_empty(query.shape)  # contiguous, whatever the layout of query
    seq_lens_host = seq_lens.tolist()
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    block_size = key_cache.shape[1]
    tables = [row[: -(-n // block_size)] for row, n in zip(block_tables.tolist(), seq_lens_host)]
    plan = _make_plan(tables, seq_lens_host, query_lens, block_size, query.shape[1] // key_cache.shape[2],
                      query.device, fresh_prompts=False,
                      in_place_decode=cpu_attention.takes(query, key_cache, value_cache) and out.is_contiguous())
    _run(plan, query, None, None, key_cache, value_cache, scale, out)
    return out


@dataclass(slots=True, frozen=True)
class _Prompt:
    """A whole prompt, attended causally on its own new K/V (query rows start:end)."""
    start: int
    end: int


@dataclass(slots=True, frozen=True)
class _Lone:
    """One sequence over its cached context: K/V are `blocks` of the cache (a slice when consecutive)."""
    start: int
    end: int
    seq_len: int
    blocks: slice | torch.Tensor
    mask: torch.Tensor | None  # [1, 1, q_len * G, seq_len] causal; None for a single query


@dataclass(slots=True, frozen=True)
class _Decode:
    """Sequences of one query each (query row `rows[s]`), attended in place by cpu_attention.c."""
    rows: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, max blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32


@dataclass(slots=True, frozen=True)
class _Batch:
    """One padded SDPA batch: `num_seqs` sequences of up to `max_q` queries over up to `max_len` keys."""
    num_seqs: int
    max_q: int
    max_len: int
    rows: torch.Tensor  # [S * max_q] query row of each padded query (a sequence's last row repeated)
    real_rows: torch.Tensor | None  # [S * max_q] bool, None when no query is padding
    blocks: torch.Tensor  # [S * max_len / block_size] the blocks to gather, in order
    past_end: torch.Tensor  # gathered slots past their sequence's length
    mask: torch.Tensor | None  # [S, 1, max_q * G, max_len] bool; None: causal over the whole prompt


def _make_plan(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int], block_size: int,
               group_size: int, device: torch.device, fresh_prompts: bool, in_place_decode: bool) -> list:
    starts = [0, *accumulate(query_lens)]
    prompts, decode, chunked = [], [], []
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        kind = prompts if q_len == seq_len else decode if q_len == 1 else chunked
        kind.append(s)
    plan: list = []
    if fresh_prompts:
        plan += [_Prompt(starts[s], starts[s + 1]) for s in prompts]
    elif prompts:
        plan.append(_plan_batch(prompts, block_tables, seq_lens, query_lens, starts, block_size, group_size,
                                device, causal=True))
    if decode and in_place_decode:
        plan.append(_plan_decode(decode, block_tables, seq_lens, starts, block_size, device))
        decode = []
    if len(decode) + len(chunked) == 1:
        s = (decode + chunked)[0]
        plan.append(_plan_lone(block_tables[s], seq_lens[s], starts[s], starts[s + 1], block_size, group_size,
                               device))
    else:
        for group in (decode, chunked):
            if group:
                plan.append(_plan_batch(group, block_tables, seq_lens, query_lens, starts, block_size,
                                        group_size, device, causal=False))
    return plan


def _plan_decode(seqs: list[int], block_tables, seq_lens, starts, block_size: int, device: torch.device) -> _Decode:
    tables = [block_tables[s][: -(-seq_lens[s] // block_size)] for s in seqs]
    width = max(map(len, tables))
    return _Decode(torch.tensor([starts[s] for s in seqs], dtype=torch.long, device=device),
                   torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
                   torch.tensor([seq_lens[s] for s in seqs], dtype=torch.int32, device=device))


def _plan_lone(table: list[int], seq_len: int, start: int, end: int, block_size: int, group_size: int,
               device: torch.device) -> _Lone:
    num_blocks = -(-seq_len // block_size)
    table = table[:num_blocks]
    if table == list(range(table[0], table[0] + num_blocks)):
        blocks: slice | torch.Tensor = slice(table[0], table[0] + num_blocks)
    else:
        blocks = torch.tensor(table, dtype=torch.long, device=device)
    mask = None
    if end - start > 1:
        positions = torch.arange(seq_len - (end - start), seq_len, device=device)
        mask = torch.arange(seq_len, device=device) <= positions[:, None]
        mask = mask.repeat_interleave(group_size, dim=0)[None, None]
    return _Lone(start, end, seq_len, blocks, mask)


def _plan_batch(seqs: list[int], block_tables, seq_lens, query_lens, starts, block_size: int, group_size: int,
                device: torch.device, causal: bool) -> _Batch:
    lens = torch.tensor([seq_lens[s] for s in seqs], device=device)
    q_lens = torch.tensor([query_lens[s] for s in seqs], device=device)
    q_starts = torch.tensor([starts[s] for s in seqs], device=device)
    num_seqs, max_q = len(seqs), max(query_lens[s] for s in seqs)
    num_blocks = -(-max(seq_lens[s] for s in seqs) // block_size)
    max_len = num_blocks * block_size
    # blocks past a sequence's own read block 0: their slots are zeroed below
    tables = [block_tables[s][: -(-seq_lens[s] // block_size)] for s in seqs]
    blocks = torch.tensor([t + [0] * (num_blocks - len(t)) for t in tables], dtype=torch.long, device=device)

    q_offsets = torch.arange(max_q, device=device)
    real_q = q_offsets < q_lens[:, None]
    rows = q_starts[:, None] + torch.minimum(q_offsets, q_lens[:, None] - 1)
    key_positions = torch.arange(max_len, device=device)
    past_end = (key_positions >= lens[:, None]).flatten().nonzero().flatten()
    mask = None
    if not causal:
        positions = lens[:, None] - q_lens[:, None] + q_offsets  # [S, max_q]
        mask = key_positions <= positions[:, :, None]  # [S, max_q, L]
        mask = mask.repeat_interleave(group_size, dim=1)[:, None]  # [S, 1, max_q * G, L]
    return _Batch(num_seqs, max_q, max_len, rows.flatten(), None if bool(real_q.all()) else real_q.flatten(),
                  blocks.flatten(), past_end, mask)


def _run(plan: list, query, key, value, key_cache, value_cache, scale, out) -> None:
    cached = None  # the step's new K/V as the cache holds them: made once, for all of its prompts
    for part in plan:
        if isinstance(part, _Prompt):
            cached = cached or (_as_cached(key, key_cache), _as_cached(value, value_cache))
            _attend_prompt(part, query, *cached, scale, out)
        elif isinstance(part, _Lone):
            _attend_lone(part, query, key_cache, value_cache, scale, out)
        elif isinstance(part, _Decode):
            cpu_attention.decode(query, part.rows, key_cache, value_cache, part.block_tables, part.seq_lens, scale,
                                 out)
        else:
            _attend_batch(part, query, key_cache, value_cache, scale, out)


def _attend_prompt(part: _Prompt, query, key, value, scale, out) -> None:
    group_size = query.shape[1] // key.shape[1]
    q = query[part.start:part.end].transpose(0, 1)
    k = _repeat_heads(key[None, part.start:part.end], group_size)[0].transpose(0, 1)
    v = _repeat_heads(value[None, part.start:part.end], group_size)[0].transpose(0, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    out[part.start:part.end] = o.transpose(0, 1)


def _as_cached(new: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New K/V [T, Hkv, D] as a reader of `cache` will see them (themselves where the cache has their dtype)."""
    return kv_quant.dequantize(kv_quant.quantize(new, cache.dtype), new.dtype)


def _attend_lone(part: _Lone, query, key_cache, value_cache, scale, out) -> None:
    num_kv_heads, head_dim = key_cache.shape[2], query.shape[2]
    q_len = part.end - part.start
    group_size = query.shape[1] // num_kv_heads

    def context(cache):
        blocks = cache[part.blocks] if isinstance(part.blocks, slice) else cache.index_select(0, part.blocks)
        rows = kv_quant.dequantize(blocks.flatten(0, 1)[: part.seq_len], query.dtype)
        return rows.transpose(0, 1)[None]  # [1, Hkv, L, D]

    # fold: [q_len, Hkv, G, D] -> [1, Hkv, q_len * G, D], rows ordered (query, head in group)
    q = query[part.start:part.end].view(q_len, num_kv_heads, group_size, head_dim).transpose(0, 1)
    q = q.reshape(1, num_kv_heads, q_len * group_size, head_dim)
    o = F.scaled_dot_product_attention(q, context(key_cache), context(value_cache), attn_mask=part.mask,
                                       scale=scale)
    out[part.start:part.end] = o.view(num_kv_heads, q_len, group_size, head_dim).transpose(0, 1).flatten(1, 2)


def _attend_batch(plan: _Batch, query, key_cache, value_cache, scale, out) -> None:
    """One padded SDPA batch for a group of sequences; writes their rows of `out`."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    s, max_q = plan.num_seqs, plan.max_q

    q = query.index_select(0, plan.rows).view(s, max_q, num_q_heads, head_dim)
    key = _gather(key_cache, plan, query.dtype)
    value = _gather(value_cache, plan, query.dtype)

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


def _gather(cache: torch.Tensor, plan: _Batch, dtype: torch.dtype) -> torch.Tensor:
    """[S, max_len, Hkv, D] in `dtype`: each sequence's context in order, zeros past its length."""
    slots = cache.index_select(0, plan.blocks).flatten(0, 1)
    slots.index_fill_(0, plan.past_end, 0)  # in an 8-bit cache, zero bytes and a zero scale: zeros too
    slots = kv_quant.dequantize(slots, dtype)
    return slots.view(plan.num_seqs, plan.max_len, *slots.shape[1:])


def _repeat_heads(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[S, L, Hkv, D] -> [S, L, Hkv * G, D], each KV head repeated for its group of query heads."""
    s, length, heads, dim = x.shape
    return x[:, :, :, None].expand(s, length, heads, group_size, dim).reshape(s, length, -1, dim)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode batch (one query per sequence): store its K/V, then attend, in plain ops that
    `torch.compile` fuses into a few loops (eager, `attention` is faster). A cache of the queries' dtype only.

    query [S, Hq, D], key/value [S, Hkv, D]; every entry of block_tables [S, NB] must be a block of the
    cache (pad with any block): the whole table is read and masked past each sequence's length.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    _store_every_slot(key, value, key_cache, value_cache, slot_mapping)
    length = block_tables.shape[1] * key_cache.shape[1]
    valid = torch.arange(length, device=query.device) < seq_lens[:, None]  # [S, L]
    keys = key_cache[block_tables].view(num_seqs, length, num_kv_heads, head_dim).float()
    values = value_cache[block_tables].view(num_seqs, length, num_kv_heads, head_dim).float()
    q = query.reshape(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim).float()
    scores = torch.einsum("skgd,slkd->skgl", q, keys) * scale
    probs = scores.masked_fill(~valid[:, None, None], float("-inf")).softmax(-1)
    values = torch.where(valid[:, :, None, None], values, 0.0)  # an unused slot may hold NaN
    out = torch.einsum("skgl,slkd->skgd", probs, values)
    return out.to(query.dtype).reshape(num_seqs, num_q_heads, head_dim)
