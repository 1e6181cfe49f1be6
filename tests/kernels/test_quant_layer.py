"""A layer's products with the row ops around them in one call (kernels/quant.py's AttentionInputs and Mlp over
cpu_quant.c), against float64 numpy on gguf's own dequantized weights, fresh random blocks, every instruction
set this CPU runs them in. The calls quantize each product's activations to 8 bits per block, as quant.linear
does (tests/kernels/test_quant_kernels.py holds that product to its exact bound); the reference here quantizes
them the same way, so what is left is fp32 arithmetic, and now and then a value that fp32 and float64 round
to neighbouring 8-bit steps."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedchat.kernels import quant
from support.quant import random_weight

ISAS = quant.available_isas()
T = GGMLQuantizationType
# (q, k, v) and (o, gate, up, down) types as files mix them: a Q4_K_M layer, one of a single type, the default
# model's Q4_1, and 32-blocks beside 256-blocks
LAYER_TYPES = [(T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0,) * 7, (T.Q4_1,) * 7,
               (T.Q4_0, T.Q5_K, T.Q8_0, T.Q6_K, T.Q4_0, T.Q5_K, T.Q8_0)]
# of the output's RMS: a value between the products that fp32 and float64 round to neighbouring 8-bit steps moves
# a call of a few rows by up to ~6e-3 of it (2e-3 failed one case in ~2,000, seed 4354501 of test_mlp on Q8_0 at
# 2 rows); a wrong block, scale, row or order moves it by 1e-1 or more
RELATIVE = 1e-2

pytestmark = pytest.mark.skipif(not ISAS, reason="cpu_quant.c could not be built here")


def random_matrix(rng: np.random.Generator, ggml_type: int, rows: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(random blocks [rows, row_bytes], their float64 values as gguf dequantizes them)"""
    raw = random_weight(rng, ggml_type, rows, depth)
    return raw, quants.dequantize(raw, ggml_type).astype(np.float64)


def eight_bit(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """x [M, K] as the kernels quantize it for a product with `ggml_type`: in fp32, per block of 32 or 256
    values, d = amax / 127 and q = x / d rounded to nearest even; returned as q * d in float64"""
    block = 256 if GGML_QUANT_SIZES[ggml_type][0] == 256 else 32
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return (np.rint(blocks * inverse).astype(np.float64) * (amax / np.float32(127))).reshape(x.shape)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps))


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """transformers' rotate_half rotary of the first `heads` heads of each row"""
    out = x.copy()
    half = head_dim // 2
    for h in range(heads):
        v = x[:, h * head_dim:(h + 1) * head_dim]
        rotated = np.concatenate([-v[:, half:], v[:, :half]], axis=1)
        out[:, h * head_dim:(h + 1) * head_dim] = v * cos + rotated * sin
    return out


def from_file_order(rows: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """transformers' order of q or k rows that llama.cpp's holds: its row 2i + j of a head is transformers' row
    j * head_dim / 2 + i"""
    return rows.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def assert_close(got: torch.Tensor, want: np.ndarray) -> None:
    error = np.sqrt(((got.numpy().astype(np.float64) - want) ** 2).mean())
    assert error <= RELATIVE * np.sqrt((want ** 2).mean()), error


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("types", LAYER_TYPES, ids=lambda ts: "-".join(T(t).name for t in ts))
@settings(max_examples=4, deadline=None)
@given(rows=st.sampled_from([1, 3, 17, quant.ROWS_PER_CALL + 9]), interleaved=st.booleans(), with_bias=st.booleans(),
       head_norms=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_attention_inputs(isa: str, types: tuple, rows: int, interleaved: bool, with_bias: bool, head_norms: bool,
                          seed: int) -> None:
    """Llama's (q and k interleaved in a llama.cpp file), Qwen2's (bias) and Qwen3's (a norm over each head)"""
    rng = np.random.default_rng(seed)
    hidden, head_dim, heads, kv_heads, eps = 512, 32, 4, 2, 1e-5
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    raws, weights = [], []  # the file's rows (q's and k's interleaved where asked) and transformers' values
    for part, (ggml_type, count) in enumerate(zip(types[:3], (heads, kv_heads, kv_heads))):
        raw, values = random_matrix(rng, ggml_type, count * head_dim, hidden)
        raws.append(raw)
        weights.append(from_file_order(values, count, head_dim) if interleaved and part < 2 else values)
    width = (heads + 2 * kv_heads) * head_dim
    bias = rng.standard_normal(width).astype(np.float32) * 0.1 if with_bias else None
    angles = rng.uniform(0, 6.3, (rows, head_dim // 2))
    cos = np.concatenate([np.cos(angles)] * 2, axis=1).astype(np.float32)
    sin = np.concatenate([np.sin(angles)] * 2, axis=1).astype(np.float32)
    sin_signed = np.concatenate([-sin[:, :head_dim // 2], sin[:, head_dim // 2:]], axis=1)

    norms = [rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2)] if head_norms else None

    op = quant.AttentionInputs(torch.from_numpy(norm), eps, *[(torch.from_numpy(r), t) for r, t in zip(raws, types)],
                               None if bias is None else torch.from_numpy(bias), head_dim, interleaved,
                               None if norms is None else tuple(map(torch.from_numpy, norms)), isa=isa)
    got = op(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin_signed))

    normed = rms_norm(x.astype(np.float64), norm, eps)
    want = np.concatenate([eight_bit(normed, t) @ w.T for t, w in zip(types, weights)], axis=1)
    if bias is not None:
        want += bias
    if norms is not None:
        for h in range(heads + kv_heads):
            columns = slice(h * head_dim, (h + 1) * head_dim)
            want[:, columns] = rms_norm(want[:, columns], norms[h >= heads], eps)
    want = rotate(want, cos, sin, heads + kv_heads, head_dim)
    assert got.shape == (rows, width)
    assert_close(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("types", LAYER_TYPES, ids=lambda ts: "-".join(T(t).name for t in ts))
@settings(max_examples=3, deadline=None)
@given(rows=st.sampled_from([1, 2, 11, quant.ROWS_PER_CALL + 9]), with_bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_mlp(isa: str, types: tuple, rows: int, with_bias: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    hidden, width, inner, eps = 256, 512, 768, 1e-6
    (o_raw, o), (g_raw, g), (u_raw, u), (d_raw, d) = (
        random_matrix(rng, t, n, k) for t, n, k in zip(types[3:], (hidden, inner, inner, hidden),
                                                        (width, hidden, hidden, inner)))
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    # a trained layer's magnitudes, each product's outputs of order one, whatever the random blocks' sizes
    attention = (rng.standard_normal((rows, width)) / (np.abs(o).mean() * np.sqrt(width))).astype(np.float32)
    norm = (rng.uniform(0.5, 1.5, hidden) / (np.abs(g).mean() * np.sqrt(hidden))).astype(np.float32)
    o_bias = rng.standard_normal(hidden).astype(np.float32) * 0.1 if with_bias else None

    op = quant.Mlp((torch.from_numpy(o_raw), types[3]), None if o_bias is None else torch.from_numpy(o_bias),
                   torch.from_numpy(norm), eps, (torch.from_numpy(g_raw), types[4]), (torch.from_numpy(u_raw), types[5]),
                   (torch.from_numpy(d_raw), types[6]), isa=isa)
    stream = torch.from_numpy(residual.copy())
    assert op(stream, torch.from_numpy(attention)) is stream  # in place

    mid = residual + eight_bit(attention, types[3]) @ o.T + (0 if o_bias is None else o_bias)
    h = rms_norm(mid, norm, eps)
    gate, up = eight_bit(h, types[4]) @ g.T, eight_bit(h, types[5]) @ u.T
    want = mid + eight_bit(gate / (1 + np.exp(-gate)) * up, types[6]) @ d.T
    assert_close(stream - torch.from_numpy(residual), want - residual)  # the layer's change, not the stream


def test_a_long_prefill_goes_to_the_layer_calls_in_pieces() -> None:
    """Each C call's scratch grows with its rows: a prefill's rows go ROWS_PER_CALL at a time, all of them once"""
    rng = np.random.default_rng(0)
    o, g, u, d = (torch.from_numpy(random_matrix(rng, T.Q8_0, n, k)[0])
                  for n, k in ((64, 64), (96, 64), (96, 64), (64, 96)))
    rows = 2 * quant.ROWS_PER_CALL + 5
    mlp = quant.Mlp((o, T.Q8_0), None, torch.ones(64), 1e-6, (g, T.Q8_0), (u, T.Q8_0), (d, T.Q8_0))
    inputs = quant.AttentionInputs(torch.ones(64), 1e-6, (o, T.Q8_0), (o, T.Q8_0), (o, T.Q8_0), None, 16, False)
    for op, rows_at in ((mlp, 2), (inputs, 1)):
        seen, call = [], op.fn
        op.fn = lambda *args, call=call, rows_at=rows_at, seen=seen: (seen.append(args[rows_at]), call(*args))
        if op is mlp:
            op(torch.ones(rows, 64), torch.ones(rows, 64))
        else:
            op(torch.ones(rows, 64), torch.ones(rows, 16), torch.ones(rows, 16))
        assert seen == [quant.ROWS_PER_CALL, quant.ROWS_PER_CALL, 5]


def test_refuses_shapes_that_do_not_chain() -> None:
    rng = np.random.default_rng(0)
    o, g, u, d = (torch.from_numpy(random_matrix(rng, T.Q8_0, n, k)[0])
                  for n, k in ((64, 64), (96, 64), (96, 64), (32, 96)))
    with pytest.raises(ValueError, match="do not chain"):
        quant.Mlp((o, T.Q8_0), None, torch.ones(64), 1e-6, (g, T.Q8_0), (u, T.Q8_0), (d, T.Q8_0))
    op = quant.AttentionInputs(torch.ones(64), 1e-6, (o, T.Q8_0), (o, T.Q8_0), (o, T.Q8_0), None, 16, False)
    with pytest.raises(ValueError, match="contiguous CPU fp32"):
        op(torch.ones(2, 64, dtype=torch.float64), torch.ones(2, 16), torch.ones(2, 16))
