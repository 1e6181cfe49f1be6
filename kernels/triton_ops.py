"""Paged KV store and paged attention as Triton kernels: the engine's backend on CUDA.

Same signatures as `torch_ops`. One attention kernel serves prefill, chunked prefill over a cached
prefix and decode in a single launch for a mixed batch:

- a program owns one KV head and a tile of BLOCK_M rows, each row a (query token, query head)
  pair of that KV head's group ("GQA packing"), so every K/V tile is loaded once per KV head;
- programs find their sequence by a binary search over query_start_loc (no host synchronisation:
  the grid is an upper bound and surplus programs exit at once);
- keys are gathered TILE_N at a time through the block table (a tile may span several blocks), and
  an online softmax in fp32 walks them up to the tile's last query, masking causally;
- the split-KV path (flash-decoding) cuts each program's key range into NUM_SPLITS parts written
  as fp32 partial results, which a second kernel merges by their log-sum-exp.

An 8-bit cache (kv_quant.py's rows: D int8 or fp8 e4m3 values, then their fp32 scale) is read in place:
its values converted to fp32 in the tile, a key's scale applied to its column of scores and a value's to
its softmax weight. Its new K/V are quantized by kv_quant.store (torch ops) as they are stored.

Dots: fp32 ones ask for IEEE precision (a GPU would default to TF32, ~1e-3 off); fp16 and bf16
ones run natively with fp32 accumulation, except bf16 under the interpreter, where tl.dot on bf16
is wrong and the tiles are converted to fp32 first.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from . import kv_quant
from .metadata import AttentionMetadata

LOG2E = 1.4426950408889634

# read once, as Triton does when the kernels below are defined
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# split-KV bounds: enough parts to fill the GPU, none so short that the merge outweighs it
MAX_KV_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, num_tokens,
                     stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                     stride_c_block, stride_c_slot, stride_c_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    # heads and dims flattened into one padded axis, so a whole token moves in one tile row
    flat = tl.arange(0, BLOCK_HD)
    head, dim = flat // HEAD_DIM, flat % HEAD_DIM
    mask = (slots >= 0)[:, None] & (flat < NUM_KV_HEADS * HEAD_DIM)[None, :]
    tokens = tokens.to(tl.int64)[:, None]
    dest = ((slots // BLOCK_SIZE) * stride_c_block + (slots % BLOCK_SIZE) * stride_c_slot)[:, None] \
        + (head * stride_c_head + dim)[None, :]
    key = tl.load(key_ptr + tokens * stride_k_t + (head * stride_k_h + dim)[None, :], mask=mask)
    value = tl.load(value_ptr + tokens * stride_v_t + (head * stride_v_h + dim)[None, :], mask=mask)
    tl.store(key_cache_ptr + dest, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dest, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if kv_quant.is_quantized(key_cache):
        kv_quant.store(key, value, key_cache, value_cache, slot_mapping)
        return
    _check_caches(key_cache, value_cache)
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = max(1, 4096 // block_hd)
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(), num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
        BLOCK_T=block_t, BLOCK_HD=block_hd)


@triton.jit
def _find_sequence(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first query tile, query_start_loc[s] // BLOCK_Q + s, is <= q_tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _cache_tile(ptrs, mask, QUANT: tl.constexpr):
    """A tile of cache values: as stored, or an 8-bit cache's (QUANT 1: int8, 2: fp8 e4m3) as unscaled fp32."""
    if QUANT == 0:
        return tl.load(ptrs, mask=mask, other=0.0)
    raw = tl.load(ptrs, mask=mask, other=0)
    if QUANT == 1:
        return raw.to(tl.float32)
    bits = raw.to(tl.int32) & 0xFF
    magnitude = bits & 0x7F  # e4m3: a normal value's exponent rebased by (127 - 7); a subnormal's mantissa * 2^-9
    normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(magnitude < 8, magnitude.to(tl.float32) * (1.0 / 512), normal)
    return tl.where((bits & 0x80) != 0, -value, value)


@triton.jit
def _row_scales(row_ptrs, mask, HEAD_DIM: tl.constexpr):
    """The fp32 scale after each row's HEAD_DIM bytes, assembled from its 4 bytes (little-endian)."""
    bits = tl.zeros(row_ptrs.shape, tl.int32)
    for i in tl.static_range(4):
        byte = tl.load(row_ptrs + HEAD_DIM + i, mask=mask, other=0).to(tl.int32) & 0xFF
        bits = bits | (byte << (8 * i))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _paged_attention_kernel(
        out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, partial_out_ptr, partial_lse_ptr, qk_scale_log2, num_seqs,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h,
        stride_c_block, stride_c_slot, stride_c_head, stride_bt,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tl.program_id(0) - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:  # surplus program of the upper-bound grid
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # query index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:  # bf16 tl.dot is wrong under the interpreter
        q = q.to(tl.float32)
    q_pos = context_len + q_idx  # absolute position: attends keys 0..q_pos

    # this tile of queries sees keys up to its last real query; splits share that range
    kv_len = context_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    cache_head = kv_head * stride_c_head
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < kv_len  # never read past the context: unused slots may hold NaN
        blocks = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slot = blocks.to(tl.int64) * stride_c_block + (keys % BLOCK_SIZE) * stride_c_slot + cache_head
        k = _cache_tile(key_cache_ptr + slot[None, :] + dims[:, None], dim_ok[:, None] & key_ok[None, :],
                        QUANT)  # [D, TILE_N]
        v = _cache_tile(value_cache_ptr + slot[:, None] + dims[None, :], key_ok[:, None] & dim_ok[None, :],
                        QUANT)  # [TILE_N, D]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * qk_scale_log2
        if QUANT != 0:
            s = s * _row_scales(key_cache_ptr + slot, key_ok, HEAD_DIM)[None, :]
        s = tl.where(keys[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # a row that sees no key yet (a later split's range starts past it) keeps p = 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        if QUANT != 0:  # a value's scale weighs its softmax weight (after the sum, which the scales do not enter)
            p = p * _row_scales(value_cache_ptr + slot, key_ok, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    if NUM_SPLITS == 1:
        o = acc / l[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:  # partials [T, Hq, NUM_SPLITS, D] and their log2-sum-exp2 [T, Hq, NUM_SPLITS], fp32
        has_keys = l > 0.0
        o = acc / tl.where(has_keys, l, 1.0)[:, None]
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
        partial_row = (q_rows * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], o,
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, partial_out_ptr, partial_lse_ptr, num_rows, stride_o_t, stride_o_h,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, ROWS: tl.constexpr):
    """out[t, h] = sum_k w_k * partial_k with w = softmax over splits of their log-sum-exp."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # row = t * Hq + h
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < num_rows
    split_ok = row_ok[:, None] & (splits < NUM_SPLITS)[None, :]
    lse = tl.load(partial_lse_ptr + rows[:, None] * NUM_SPLITS + splits[None, :], mask=split_ok,
                  other=float("-inf"))  # [ROWS, SPLITS_PAD]
    # every real row has keys in its first split, so the max is finite there
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max[:, None])
    part_ptrs = partial_out_ptr + ((rows[:, None] * NUM_SPLITS + splits[None, :]) * HEAD_DIM)[:, :, None] \
        + dims[None, None, :]
    part = tl.load(part_ptrs, mask=split_ok[:, :, None] & (dims < HEAD_DIM)[None, None, :], other=0.0)
    weight = tl.where(row_ok, tl.sum(w, axis=1), 1.0)  # rows past the end: 0 / 0 otherwise
    o = tl.sum(part * w[:, :, None], axis=1) / weight[:, None]
    token, head = rows // NUM_HEADS, rows % NUM_HEADS
    tl.store(out_ptr + (token * stride_o_t + head * stride_o_h)[:, None] + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len positions) over its paged context."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads, "Hkv must divide Hq"
    _check_caches(key_cache, value_cache)
    if out is None:
        out = query.new_empty(query.shape)  # contiguous, whatever the layout of query
    assert query.stride(2) == 1 and out.stride(2) == 1, "head_dim must be contiguous"
    if num_tokens == 0:
        return out

    # every sequence has at least one query, so T == S means a pure decode batch (known without a sync)
    decode_only = num_tokens == num_seqs
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, tile_n, num_warps = _tiles(decode_only, group, head_dim_pad, query.dtype)
    block_q = 1 if decode_only else block_m // group
    splits = _num_splits(num_kv_splits, decode_only, num_seqs * num_kv_heads,
                         block_tables.shape[1] * key_cache.shape[1], query.device)
    if splits > 1:
        partial_out = torch.empty(num_tokens, num_q_heads, splits, head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32,
                                  device=query.device)
    else:  # unused by the kernel; any tensor will do for the pointer
        partial_out = partial_lse = out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        partial_out, partial_lse, scale * LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=key_cache.shape[1], GROUP=group,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, NUM_SPLITS=splits,
        UPCAST=(INTERPRETING and key_cache.dtype == torch.bfloat16) or key_cache.dtype != query.dtype,
        QUANT={torch.int8: 1, torch.uint8: 2}.get(key_cache.dtype, 0), num_warps=num_warps)
    if splits > 1:
        num_rows = num_tokens * num_q_heads
        rows_per_program = 64 if INTERPRETING else 1
        _merge_splits_kernel[(triton.cdiv(num_rows, rows_per_program),)](
            out, partial_out, partial_lse, num_rows, out.stride(0), out.stride(1),
            NUM_HEADS=num_q_heads, HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits), ROWS=rows_per_program)
    return out


def _tiles(decode_only: bool, group: int, head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, TILE_N, num_warps). A decode tile holds one query token's group of heads."""
    group_rows = max(16, triton.next_power_of_2(group))  # tl.dot wants M >= 16
    if INTERPRETING:  # ~ms of Python per program and per loop iteration, whatever the tile size
        return (group_rows if decode_only else max(128, group_rows)), 128, 4
    # Sized by ptxas on sm_90 to stay clear of register spills: the gathered K/V tiles take one
    # pointer per vector, and fp32 dots with IEEE precision run on FMA units with wide layouts.
    num_warps = 8 if head_dim_pad >= 128 or dtype == torch.float32 else 4
    if decode_only or dtype == torch.float32:
        return group_rows, 32, num_warps
    return max(64, group_rows), 32, num_warps


def _num_splits(requested: int | None, decode_only: bool, num_programs: int, max_context: int,
                device: torch.device) -> int:
    """Split the keys only when a decode batch alone would leave most of the GPU idle."""
    if requested is not None:
        assert requested >= 1, "num_kv_splits must be >= 1"
        return requested
    if INTERPRETING or not decode_only or device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * _num_sms(device), num_programs)
    return max(1, min(wanted, MAX_KV_SPLITS, triton.cdiv(max_context, MIN_KEYS_PER_SPLIT)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride(), \
        "key and value caches must share shape and layout"
    assert key_cache.stride(3) == 1, "head_dim must be contiguous in the caches"


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer's attention for a step: store the new K/V [T, Hkv, D], then attend query [T, Hq, D]."""
    store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
    return paged_attention(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                           metadata.query_start_loc, scale)
