"""The 8-bit KV cache (kernels/kv_quant.py's format): its store against the bound that 8 bits explain, and
every reader of it (the torch path, cpu_attention.c in place, the Triton kernel under TRITON_INTERPRET=1)
against a float64 reference that dequantizes the same blocks with its own decoding of the bytes."""

import math

import numpy as np
import pytest
import torch
from test_kernels import make_batch, mixed_seqs, reference_attention, relative_error

from pagedchat.kernels import AttentionMetadata, cpu_attention, kv_quant, native, torch_ops, triton_ops

FORMATS = {"int8": torch.int8, "fp8": torch.uint8}
QUERY_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # the arithmetic's, over the same dequantized blocks
has_avx2 = native.AVX2_CPU_FLAGS <= native.cpu_flags()
# the readers of a cache: torch's own ops (cpu_attention.c kept out), cpu_attention.c in place, Triton
PATHS = ["torch", pytest.param("c", marks=pytest.mark.skipif(not has_avx2, reason="cpu_attention.c needs AVX2")),
         "triton"]


def e4m3_value(bits: int) -> float:
    """The e4m3fn value of a byte, from the format's definition (bias 7, 3 mantissa bits, no infinities)."""
    sign = -1.0 if bits & 0x80 else 1.0
    exponent, mantissa = (bits >> 3) & 0xF, bits & 7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3 = np.array([e4m3_value(b) for b in range(256)])


def reference_dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Float64 [..., D] from an 8-bit cache's rows [..., D + 4], decoded from the bytes alone."""
    raw = rows.contiguous().view(torch.uint8).numpy()
    scale = raw[..., -4:].copy().view("<f4")[..., 0].astype(np.float64)
    data = raw[..., :-4]
    values = data.view(np.int8).astype(np.float64) if rows.dtype == torch.int8 else E4M3[data]
    return torch.from_numpy(values * scale[..., None])


def error_bound(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """What rounding to 8 bits may cost each value of rows x [..., D]: half a step of the row's scale (int8),
    or half a unit in the last of 3 mantissa bits, and half the subnormal step below 2^-6 (fp8)."""
    scale = x.abs().amax(-1, keepdim=True).double() / kv_quant.QMAX[fmt]
    if fmt == torch.int8:
        return scale / 2 * (1 + 1e-5)
    return (x.abs().double() * 2.0 ** -4 + scale * 2.0 ** -10) * (1 + 1e-5)


def quantized_batch(fmt: torch.dtype, dtype: torch.dtype, block_size: int = 16, seqs=None, seed: int = 0) -> dict:
    """test_kernels' paged batch with its caches quantized (its NaN slots as zero rows)."""
    batch = make_batch(seqs or mixed_seqs(block_size), 64, block_size, dtype, 9, 3, seed=seed)
    for name in ("key_cache", "value_cache"):
        batch[name] = kv_quant.quantize(batch[name].nan_to_num(0.0), fmt)
    return batch


@pytest.fixture
def path(request, monkeypatch):
    """The reader asked for: 'torch' keeps cpu_attention.c out; 'c' makes sure it is in."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_attention, "takes", lambda *args: False)
    elif request.param == "c":
        assert cpu_attention.kernel() is not None
    return request.param


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", [torch_ops, triton_ops], ids=["torch", "triton"])
def test_the_store_keeps_each_value_within_what_8_bits_explain(impl, fmt):
    fmt = FORMATS[fmt]
    gen = torch.Generator().manual_seed(1)
    # rows of very different sizes, a zero row and an outlier: each row's scale is its own
    key = torch.randn(7, 3, 64, generator=gen) * torch.logspace(-3, 2, 7)[:, None, None]
    value = torch.randn(7, 3, 64, generator=gen)
    key[2, 1] = 0.0
    value[4, 0, 5] = 50.0
    key_cache = torch.full((4, 8, 3, 68), 99, dtype=fmt)
    value_cache = key_cache.clone()
    slots = torch.tensor([3, 17, -1, 8, 31, 0, 12])
    impl.store_kv(key, value, key_cache, value_cache, slots)
    for new, cache in ((key, key_cache), (value, value_cache)):
        stored = reference_dequantize(cache.view(-1, 3, 68)[slots[slots >= 0]])
        expected = new[slots >= 0].double()
        assert ((stored - expected).abs() <= error_bound(new[slots >= 0], fmt)).all()
        assert (cache.view(-1, 3, 68)[2] == 99).all()  # a negative slot writes nothing
        assert torch.equal(kv_quant.scales(cache.view(-1, 3, 68)[slots[slots >= 0]]),
                           new[slots >= 0].abs().amax(-1).where(new[slots >= 0].abs().amax(-1) > 0, kv_quant.QMAX[fmt])
                           / kv_quant.QMAX[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_byte_dequantizes_as_the_format_defines(fmt):
    fmt = FORMATS[fmt]
    rows = torch.zeros(256, 68, dtype=torch.uint8)
    rows[:, 0] = torch.arange(256)
    rows[:, 64:] = torch.tensor([0.5], dtype=torch.float32).view(torch.uint8)
    rows = rows.view(fmt)
    if fmt == torch.uint8:
        rows = rows[(rows[:, 0] & 0x7F) != 0x7F]  # e4m3fn's NaNs, never stored
    assert torch.equal(kv_quant.dequantize(rows, torch.float64)[:, 0], reference_dequantize(rows)[:, 0])


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
def test_8_bit_attention_is_the_float_attention_of_the_dequantized_blocks(path, fmt, dtype):
    dtype, fmt = QUERY_DTYPES[dtype], FORMATS[fmt]
    seqs = [(1, 1), (48, 1), (317, 1), (130, 1)] if path == "c" else mixed_seqs(16)  # the C kernel: decodes
    batch = quantized_batch(fmt, dtype, seqs=seqs, seed=hash((path, fmt, dtype)) % 1000)
    expected = reference_attention(**batch | {name: reference_dequantize(batch[name])
                                              for name in ("key_cache", "value_cache")})
    impl = triton_ops if path == "triton" else torch_ops
    out = impl.paged_attention(**batch)
    assert out.dtype == dtype
    assert relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("path", ["torch", "c"], indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
def test_a_step_over_an_8_bit_cache_stores_then_attends_what_it_stored(path, fmt, dtype):
    """The engine's call: new K/V quantized into their slots (by cpu_attention.c in the same call, for a step
    of decodes), then every query attends the cache as it holds them, its own new K/V included."""
    dtype, fmt = QUERY_DTYPES[dtype], FORMATS[fmt]
    gen = torch.Generator().manual_seed(hash((path, fmt)) % 1000)
    block_size, contexts = 16, [40, 1, 77, 16]
    decode_only = path == "c"
    q_lens = [1] * len(contexts) if decode_only else [1, 1, 9, 16]
    seq_lens = [c + q for c, q in zip(contexts, q_lens)]
    tables = [[int(b) for b in torch.randperm(40, generator=gen)[: math.ceil(n / block_size)]] for n in seq_lens]
    tables = [[t + 40 * i for t in table] for i, table in enumerate(tables)]  # disjoint
    key_cache = kv_quant.quantize(torch.randn(160, block_size, 3, 64, generator=gen), fmt)
    value_cache = kv_quant.quantize(torch.randn(160, block_size, 3, 64, generator=gen), fmt)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, n in zip(tables, contexts, seq_lens) for p in range(c, n)]
    metadata = AttentionMetadata.build(tables, seq_lens, q_lens, slots)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, 9, 64, generator=gen).to(dtype)
    key = torch.randn(num_tokens, 3, 64, generator=gen).to(dtype)
    value = torch.randn(num_tokens, 3, 64, generator=gen).to(dtype)
    expected_keys = key_cache.clone().view(-1, 3, 68)
    expected_keys[torch.tensor(slots)] = kv_quant.quantize(key, fmt)
    out = torch_ops.attention(query, key, value, key_cache, value_cache, metadata, 0.125)
    assert torch.equal(key_cache.view(-1, 3, 68), expected_keys)  # the C store quantizes as kv_quant does
    batch = {"query": query, "key_cache": reference_dequantize(key_cache),
             "value_cache": reference_dequantize(value_cache), "block_tables": metadata.block_tables,
             "seq_lens": metadata.seq_lens, "query_start_loc": metadata.query_start_loc, "scale": 0.125}
    assert relative_error(out, reference_attention(**batch)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("fmt,bound", [("int8", 0.02), ("fp8", 0.06)])
def test_8_bit_attention_is_near_the_attention_of_the_unquantized_kv(fmt, bound):
    """What the format costs: attention over the quantized blocks against over the floats they came from."""
    batch = make_batch(mixed_seqs(16), 64, 16, torch.float32, 9, 3, seed=5)
    exact = reference_attention(**batch)
    for name in ("key_cache", "value_cache"):
        batch[name] = kv_quant.quantize(batch[name].nan_to_num(0.0), FORMATS[fmt])
    assert relative_error(torch_ops.paged_attention(**batch), exact) <= bound


@pytest.mark.skipif(not has_avx2, reason="cpu_attention.c needs AVX2")
@pytest.mark.parametrize("heads, head_dim", [((12, 2), 64), ((5, 1), 72), ((7, 7), 40)])
@pytest.mark.parametrize("cache", ["fp32", "int8"])
def test_the_c_kernel_takes_any_group_in_chunks_and_any_head_dim_of_8s(heads, head_dim, cache):
    """Groups of 6 (chunks of 4 and 2), 5 and 1 query heads a KV head; D of 72 and 40 (past the 16-lane loop)."""
    batch = make_batch([(1, 1), (40, 1), (203, 1)], head_dim, 16, torch.float32, *heads, seed=head_dim)
    if cache == "int8":
        for name in ("key_cache", "value_cache"):
            batch[name] = kv_quant.quantize(batch[name].nan_to_num(0.0), torch.int8)
    assert cpu_attention.takes(batch["query"], batch["key_cache"], batch["value_cache"])
    reference = batch | {name: reference_dequantize(batch[name]) if cache == "int8" else batch[name]
                         for name in ("key_cache", "value_cache")}
    assert relative_error(torch_ops.paged_attention(**batch), reference_attention(**reference)) <= 1e-5
