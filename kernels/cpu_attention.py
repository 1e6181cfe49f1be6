"""Decode attention over the paged cache by kernels/cpu_attention.c (AVX2; fp32, bf16 and fp16 queries over a
cache of those or an 8-bit one, kv_quant.py's format) and kernels/cpu_attention_bf16.c (bf16 queries over a bf16
cache on a CPU with avx512_bf16, the same call), built and loaded by `native`: every sequence with one query
attended in one call, its K/V read in place through its block table."""

import functools

import torch

from . import kv_quant, native

# the `cache_kind` of cpu_attention.c: avx2.h's kinds, then the 8-bit caches
CACHE_KINDS = native.KINDS | {torch.int8: 3, torch.uint8: 4}


@functools.cache
def kernel() -> native.Kernel | None:
    return native.function("cpu_attention.c", "pagedchat_decode_attention")


@functools.cache
def kernel_bf16() -> native.Kernel | None:
    return native.function("cpu_attention_bf16.c", "pagedchat_decode_attention_bf16", isa="avx512_bf16")


def name(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> str | None:
    """The C file that attends queries of this dtype over a cache of `cache_dtype` (theirs where None) on this
    CPU, or None where neither is built."""
    cache_dtype = cache_dtype or dtype
    if dtype == cache_dtype == torch.bfloat16 and kernel_bf16() is not None:
        return "cpu_attention_bf16"
    return "cpu_attention" if kernel() is not None and dtype in native.KINDS and cache_dtype in CACHE_KINDS else None


def takes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernels take these: built, on the CPU, dtypes they know, heads of D contiguous."""
    head_dim = query.shape[2]
    return (kernel() is not None and query.device.type == "cpu" and query.dtype in native.KINDS
            and key_cache.dtype == value_cache.dtype and key_cache.dtype in CACHE_KINDS
            and kv_quant.head_dim(key_cache) == head_dim and query.stride()[1:] == (head_dim, 1)
            and head_dim % 8 == 0 and key_cache.is_contiguous() and value_cache.is_contiguous())


def decode(query: torch.Tensor, rows: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
           new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """out[rows] = attention of query[rows] (one query each) over their sequences' cached K/V; `new`: the
    step's (key, value, slot_mapping, of the queries' dtype), stored into the cache by the same call, in its
    format. The caller checks `takes`."""
    DecodeStep(query, rows, key_cache, block_tables, seq_lens, scale, out, new)(key_cache, value_cache)


class DecodeStep:
    """`decode` with all but the caches bound: a step's every layer attends the same rows over the same block
    tables, from and into buffers that a model may reuse layer after layer, so that each layer's call is one C
    call with nothing to compute in Python (a small model's decode step makes dozens). Holds its tensors; the
    caches passed to each call are of `key_cache`'s dtype and shape."""

    def __init__(self, query: torch.Tensor, rows: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                 new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        num_q_heads, head_dim = query.shape[1:]
        block_size, num_kv_heads = key_cache.shape[1:3]
        key, value, slots = (None, None, None) if new is None else new
        self.keep = (query, rows, block_tables, seq_lens, out, new)
        bf16 = query.dtype == key_cache.dtype == torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 256
        self.attend = (kernel_bf16() if bf16 else None) or kernel()
        self.head = (query.data_ptr(), query.stride(0), rows.data_ptr())
        self.tail = (block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), len(rows), num_q_heads,
                     num_kv_heads, head_dim, block_size, native.KINDS[query.dtype], CACHE_KINDS[key_cache.dtype],
                     scale, out.data_ptr(), out.stride(0), *_rows(key), *_rows(value), native.pointer(slots))

    def __call__(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        self.attend(*self.head, key_cache.data_ptr(), value_cache.data_ptr(), *self.tail, torch.get_num_threads())


def _rows(tensor: torch.Tensor | None) -> tuple[int | None, int]:
    return (None, 0) if tensor is None else (tensor.data_ptr(), tensor.stride(0))
