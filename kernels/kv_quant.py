"""The 8-bit KV cache's format, in torch: what the store writes and what every reader dequantizes.

A cache row is one token slot's one KV head: D values. An 8-bit cache stores a row as D bytes followed by
its fp32 scale in 4 bytes (a row of D + 4 bytes, so the cache tensor is [blocks, block_size, Hkv, D + 4]):
int8 symmetric (value = q * scale, scale = absmax / 127) or fp8 e4m3 (value = e4m3(q) * scale, scale =
absmax / 448). A scale per row, not per block, because rows arrive one token at a time and a block's scale
could not grow without requantizing what it already holds; and per row rather than per group of 32 values
because a dot product with a row then takes its scale once, after the sum (as vLLM folds `k_scale` into the
softmax scale). The scales sit inside the rows, so a block's bytes are one slice of the tensor: copying a
block (copy-on-write) copies its scales.

The tensor's dtype names the format: torch.int8 for int8, torch.uint8 for fp8 (the e4m3 bits: torch's CPU
index ops refuse float8 dtypes). Either way the last 4 bytes of a row are read as a float32.
"""

import torch

SCALE_BYTES = 4
# the largest |q| each format stores: its scale maps a row's absmax there
QMAX = {torch.int8: 127.0, torch.uint8: 448.0}
# the cache dtype of each name of `kv_cache_dtype` (the 16-bit ones are plain caches)
CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.uint8, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}
NAMES = {dtype: name for name, dtype in CACHE_DTYPES.items()}


def is_quantized(cache: torch.Tensor | torch.dtype) -> bool:
    return (cache if isinstance(cache, torch.dtype) else cache.dtype) in QMAX


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """The bytes of one row (a slot's KV head) in a cache of `dtype`, its scale included."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim * dtype.itemsize


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """The last dimension of a cache of `dtype` for rows of `head_dim` values."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] as a cache of `dtype` stores them: [..., D + 4] of dtype (a plain dtype: x in it)."""
    if not is_quantized(dtype):
        return x.to(dtype)
    x = x.float()
    qmax = QMAX[dtype]
    top = x.abs().amax(-1, keepdim=True)
    scale = torch.where(top > 0, top / qmax, 1.0)
    q = (x / scale).clamp(-qmax, qmax)  # x / (top / qmax) can round past qmax, which fp8 would make NaN
    q = q.round().to(torch.int8) if dtype == torch.int8 else q.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], -1).view(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of each row of an 8-bit cache: [...] from [..., D + 4]."""
    return rows[..., -SCALE_BYTES:].view(torch.float32)[..., 0]


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D(+4)] of a cache as `dtype` values [..., D]: what every reader of the cache sees."""
    if not is_quantized(rows):
        return rows.to(dtype)
    values = rows[..., :-SCALE_BYTES]
    values = values.float() if rows.dtype == torch.int8 else values.view(torch.float8_e4m3fn).float()
    return (values * scales(rows)[..., None]).to(dtype)


def store(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t], as the cache's dtype stores them;
    negative slots are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for new, cache in ((key, key_cache), (value, value_cache)):
        # view (not reshape): a cache that cannot be viewed flat must fail, not be written as a copy
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, quantize(new[keep], cache.dtype))
