"""Both kernel implementations (torch and Triton, the latter under TRITON_INTERPRET=1) against a
naive reference: a loop per sequence, a gather through the block table, a softmax in float64."""

import itertools
import math

import pytest
import torch
from pagedchat.kernels import AttentionMetadata, cpu_attention, native, torch_ops, triton_ops

from pagedchat import kernels

IMPLEMENTATIONS = {"torch": torch_ops, "triton": triton_ops}
decode = cpu_attention.decode
needs_avx2 = pytest.mark.skipif(not native.AVX2_CPU_FLAGS <= native.cpu_flags(), reason="cpu_attention.c needs AVX2")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HEADS = {"mha": (2, 2), "gqa3": (9, 3), "gqa4": (8, 2)}  # (Hq, Hkv): group sizes 1, 3, 4

# Pairwise cover of (head_dim, block_size, dtype, heads, num_kv_splits): every pair of values of any
# two parameters occurs in some row (test_cases_are_pairwise checks it), in 12 rows instead of 324.
CASES = [
    (64, 32, "fp32", "gqa4", None), (64, 16, "fp16", "mha", 1), (64, 8, "bf16", "gqa3", 3),
    (80, 32, "fp16", "gqa3", 3), (80, 8, "fp32", "mha", 1), (80, 16, "bf16", "gqa4", None),
    (96, 16, "fp32", "gqa3", 1), (96, 8, "fp16", "gqa4", 3), (96, 32, "bf16", "mha", None),
    (128, 32, "bf16", "gqa4", 1), (128, 16, "fp32", "mha", 3), (128, 8, "fp16", "gqa3", None),
]


def make_batch(seqs: list[tuple[int, int]], head_dim: int, block_size: int, dtype: torch.dtype,
               num_q_heads: int, num_kv_heads: int, seed: int = 0) -> dict:
    """A paged batch: seqs are (seq_len, q_len); blocks shuffled, free slots and spare table entries garbage."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_needed) + 3  # spare blocks stay NaN, like freed ones
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_needed) + 1
    # spare entries point nowhere: an implementation that followed one would fail loudly
    block_tables = torch.full((len(seqs), max_blocks), torch.iinfo(torch.int32).max, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    used = 0
    for s, ((seq_len, _), n) in enumerate(zip(seqs, blocks_needed)):
        block_tables[s, :n] = order[used:used + n].to(torch.int32)
        used += n
        positions = torch.arange(seq_len)  # fill exactly the context's slots, leave the rest NaN
        blocks, offsets = block_tables[s, positions // block_size].long(), positions % block_size
        key_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        value_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_lens = [q_len for _, q_len in seqs]
    num_tokens = sum(q_lens)
    return dict(
        query=torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype),
        key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        scale=head_dim ** -0.5,
    )


def reference_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                        scale) -> torch.Tensor:
    """Float64, one sequence at a time, causal over the context gathered by its block table."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for s in range(len(seq_lens)):
        seq_len = int(seq_lens[s])
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        positions = torch.arange(seq_len)
        blocks = block_tables[s, positions // block_size].long()
        k = key_cache[blocks, positions % block_size].double().repeat_interleave(group, dim=1)
        v = value_cache[blocks, positions % block_size].double().repeat_interleave(group, dim=1)
        q = query[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def mixed_seqs(block_size: int) -> list[tuple[int, int]]:
    """(seq_len, q_len): decode rows, whole prompts and chunks after a cached prefix, ragged, in one batch."""
    return [
        (1, 1),                          # a one-token prompt
        (3 * block_size, 1),             # decode ending exactly on a block boundary
        (317, 1),                        # long decode, > 300
        (41, 41),                        # whole prompt
        (4 * block_size, block_size),    # chunk ending on a block boundary
        (305, 23),                       # chunk after a long cached prefix
        (130, 1),
        (9, 9),
    ]


def test_cases_are_pairwise():
    values = [sorted({case[i] for case in CASES}, key=str) for i in range(5)]
    assert [len(v) for v in values] == [4, 3, 3, 3, 3]
    for i, j in itertools.combinations(range(5), 2):
        seen = {(case[i], case[j]) for case in CASES}
        assert seen == set(itertools.product(values[i], values[j])), (i, j)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("head_dim,block_size,dtype,heads,splits", CASES)
def test_paged_attention(impl, head_dim, block_size, dtype, heads, splits):
    dtype = DTYPES[dtype]
    batch = make_batch(mixed_seqs(block_size), head_dim, block_size, dtype, *HEADS[heads],
                       seed=head_dim + block_size)
    expected = reference_attention(**batch)
    out = torch.full_like(batch["query"], float("nan"))
    result = IMPLEMENTATIONS[impl].paged_attention(**batch, out=out, num_kv_splits=splits)
    assert result is out and out.dtype == dtype
    assert relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_paged_attention_decode_batch(impl):
    """The engine's hot case: one query per sequence; int64 index tensors accepted too."""
    seqs = [(n, 1) for n in (7, 16, 64, 100, 255, 256, 300, 333)]
    batch = make_batch(seqs, 64, 16, torch.float32, 9, 3, seed=1)
    expected = reference_attention(**batch)
    for key in ("block_tables", "seq_lens", "query_start_loc"):
        batch[key] = batch[key].long()
    for splits in (None, 1, 4):
        out = torch.full_like(batch["query"], float("nan"))
        IMPLEMENTATIONS[impl].paged_attention(**batch, out=out, num_kv_splits=splits)
        assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_paged_attention_prefill_only(impl):
    """Whole prompts only (the torch causal fast path), of unequal lengths."""
    batch = make_batch([(70, 70), (5, 5), (129, 129)], 64, 16, torch.float32, 4, 2, seed=2)
    expected = reference_attention(**batch)
    out = torch.full_like(batch["query"], float("nan"))
    IMPLEMENTATIONS[impl].paged_attention(**batch, out=out)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_paged_attention_strided_query(impl):
    """The query as the model hands it over ([1, H, T, D] transposed); the result is a new contiguous tensor."""
    batch = make_batch([(20, 20), (33, 1), (50, 6)], 64, 8, torch.float32, 4, 2, seed=3)
    expected = reference_attention(**batch)
    batch["query"] = batch["query"].transpose(0, 1).contiguous().transpose(0, 1)
    out = IMPLEMENTATIONS[impl].paged_attention(**batch)
    assert out.is_contiguous() and out.dtype == torch.float32
    assert relative_error(out, expected) <= 1e-5


def step_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step's new K/V (each sequence's last q_len positions, as the cache holds them, so storing
    them changes nothing) and its metadata, from a batch of make_batch."""
    key_cache, block_size = batch["key_cache"], batch["key_cache"].shape[1]
    seq_lens, starts = batch["seq_lens"].tolist(), batch["query_start_loc"].tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    tables = [row[: -(-n // block_size)] for row, n in zip(batch["block_tables"].tolist(), seq_lens)]
    slots = [tables[s][p // block_size] * block_size + p % block_size
             for s, (n, q) in enumerate(zip(seq_lens, query_lens)) for p in range(n - q, n)]
    flat = (-1, *key_cache.shape[2:])
    index = torch.tensor(slots)
    key, value = key_cache.view(flat)[index], batch["value_cache"].view(flat)[index]
    return key, value, AttentionMetadata.build(tables, seq_lens, query_lens, slots)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("seqs", [
    "mixed", [(130, 1)], [(305, 23)], [(64, 64), (9, 9)], [(40, 1), (200, 1)],
], ids=["mixed", "lone-decode", "lone-chunk", "prompts", "decode-batch"])
def test_attention_of_a_step(impl, seqs):
    """`attention`, the engine's entry: new K/V stored, then attended, planned once from the metadata and
    reused, on every kind of step (a lone sequence, whole prompts on their own K/V, batches)."""
    seqs = mixed_seqs(8) if seqs == "mixed" else seqs
    batch = make_batch(seqs, 64, 8, torch.float32, 9, 3, seed=len(seqs))
    expected = reference_attention(**batch)
    key, value, metadata = step_inputs(batch)
    for _ in range(2):  # the second layer of the step reuses the plan the first one made
        out = IMPLEMENTATIONS[impl].attention(batch["query"], key, value, batch["key_cache"], batch["value_cache"],
                                              metadata, batch["scale"])
        assert relative_error(out, expected) <= 1e-5


def test_lone_chunk_on_consecutive_blocks_reads_the_cache_in_place():
    batch = make_batch([(100, 5)], 64, 16, torch.float32, 4, 2, seed=4)
    batch["block_tables"][0, :7] = torch.arange(2, 9)  # blocks 2..8, in order
    key_cache, value_cache = batch["key_cache"], batch["value_cache"]
    for cache in (key_cache, value_cache):
        cache[2:9] = torch.randn(7, 16, 2, 64)
        cache[2:9].view(-1, 2, 64)[100:] = float("nan")
    expected = reference_attention(**batch)
    key, value, metadata = step_inputs(batch)
    out = torch_ops.attention(batch["query"], key, value, key_cache, value_cache, metadata, batch["scale"])
    assert isinstance(metadata.plan[0].blocks, slice)
    assert relative_error(out, expected) <= 1e-5


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])  # bf16 with avx512_bf16: 72 is cpu_attention.c's
def test_decoding_sequences_are_attended_in_place_through_their_tables(dtype, head_dim):
    """cpu_attention.c (cpu_attention_bf16.c for bf16 where the CPU has avx512_bf16): every single-query
    sequence of a step in one call, beside a prompt and a chunk, over shuffled blocks whose slots past each
    length hold NaN, with 1, 3 and 4 query heads per KV head."""
    for heads, kv_heads in ((4, 4), (9, 3), (8, 2)):
        seqs = [(1, 1), (33, 1), (12, 12), (70, 6), (200, 1), (17, 1)]
        batch = make_batch(seqs, head_dim, 16, dtype, heads, kv_heads, seed=heads)
        expected = reference_attention(**batch)
        key, value, metadata = step_inputs(batch)
        out = torch_ops.attention(batch["query"], key, value, batch["key_cache"], batch["value_cache"], metadata,
                                  batch["scale"])
        decodes = [part for part in metadata.plan if type(part).__name__ == "_Decode"]
        assert len(decodes) == 1 and decodes[0].rows.tolist() == [1, 20, 21]
        assert out.dtype == dtype and relative_error(out, expected) <= TOLERANCE[dtype]


@needs_avx2
@pytest.mark.parametrize("cache", ["fp16", "int8", "fp8"])
def test_decode_tasks_cover_every_head_however_the_threads_split_them(cache, threads, monkeypatch):
    """cpu_attention.c makes a task of a sequence's KV heads, or of a share of them where the sequences are
    fewer than twice the threads (shares of unequal sizes where they do not divide the heads): 1 to 3 threads
    over 1 to 6 decodes, a group of 6 query heads (one chunk of 4 and one of 2) and groups of 1 and 3."""
    fmt = {"int8": torch.int8, "fp8": torch.uint8}.get(cache)
    calls = []
    monkeypatch.setattr(cpu_attention, "decode", lambda *args, **kw: calls.append(decode(*args, **kw)))
    for (heads, kv_heads), count, n in itertools.product([(12, 2), (3, 3), (15, 5)], [1, 2, 3, 6], [1, 2, 3]):
        threads(n)
        batch = make_batch([(37 * (i + 1) % 90 + 1, 1) for i in range(count)], 64, 16, torch.float32, heads,
                           kv_heads, seed=count * n + heads)
        if fmt is None:
            batch["key_cache"], batch["value_cache"] = (batch[name].half() for name in ("key_cache", "value_cache"))
        else:
            for name in ("key_cache", "value_cache"):
                batch[name] = kernels.kv_quant.quantize(batch[name].nan_to_num(0.0), fmt)
        read = {name: (batch[name].float() if fmt is None else kernels.kv_quant.dequantize(batch[name], torch.float32))
                for name in ("key_cache", "value_cache")}
        expected = reference_attention(**batch | read)
        calls.clear()
        out = torch_ops.paged_attention(**batch)
        assert len(calls) == 1 and relative_error(out, expected) <= 1e-5, (heads, kv_heads, count, n)


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_decodes_stores_its_new_kv_in_the_call_that_attends(dtype):
    """A step of decodes only: cpu_attention.c writes each new K/V (strided views of one q/k/v product, as
    the lean model hands them) into its slot, which held NaN, before it attends over it."""
    batch = make_batch([(n, 1) for n in (2, 9, 16, 17, 130)], 64, 16, dtype, 9, 3, seed=6)
    expected = reference_attention(**batch)
    key, value, metadata = step_inputs(batch)
    qkv = torch.cat([torch.randn(len(key), 9 * 64).to(dtype), key.flatten(1), value.flatten(1)], dim=1)
    new_key, new_value = qkv[:, 9 * 64:12 * 64].view(-1, 3, 64), qkv[:, 12 * 64:].view(-1, 3, 64)
    flat = (-1, 3, 64)
    for cache in (batch["key_cache"], batch["value_cache"]):
        cache.view(flat)[metadata.slot_mapping] = float("nan")
    out = torch_ops.attention(batch["query"], new_key, new_value, batch["key_cache"], batch["value_cache"],
                              metadata, batch["scale"])
    assert [type(part).__name__ for part in metadata.plan] == ["_Decode"]
    assert torch.equal(batch["key_cache"].view(flat)[metadata.slot_mapping], key)
    assert torch.equal(batch["value_cache"].view(flat)[metadata.slot_mapping], value)
    assert out.dtype == dtype and relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_whole_tables(dtype):
    """The compiled step's attention: whole padded tables read, masked past each length (NaN slots)."""
    seqs = [(n, 1) for n in (1, 7, 16, 100, 255)]
    batch = make_batch(seqs, 64, 16, dtype, 9, 3, seed=5)
    batch["block_tables"][batch["block_tables"] == torch.iinfo(torch.int32).max] = 0  # pad with a real block
    expected = reference_attention(**batch)
    key, value, metadata = step_inputs(batch)
    out = torch_ops.decode_attention(batch["query"], key, value, batch["key_cache"], batch["value_cache"],
                                     metadata.slot_mapping, batch["block_tables"].long(), batch["seq_lens"],
                                     batch["scale"])
    assert out.dtype == dtype and relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv(impl, slot_dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 5, 8, 3, 80
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = key_cache.clone()
    key, value = torch.randn(2, 6, num_kv_heads, head_dim)
    slots = torch.tensor([17, -1, 0, 39, -5, 8], dtype=slot_dtype)
    IMPLEMENTATIONS[impl].store_kv(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, num_kv_heads, head_dim), value_cache.view(-1, num_kv_heads, head_dim)
    kept = slots >= 0
    assert torch.equal(flat_k[slots[kept].long()], key[kept])
    assert torch.equal(flat_v[slots[kept].long()], value[kept])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[kept].long()] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_store_kv_strided_bf16(impl):
    """Keys as the model hands them over ([1, Hkv, T, D] transposed: not contiguous), into a bf16 cache."""
    key_cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(1, 2, 10, 64, dtype=torch.bfloat16)[0].transpose(0, 1)
    value = torch.randn(1, 2, 10, 64, dtype=torch.bfloat16)[0].transpose(0, 1)
    slots = torch.arange(20, 30)
    IMPLEMENTATIONS[impl].store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 2, 64)[20:30], key)
    assert torch.equal(value_cache.view(-1, 2, 64)[20:30], value)


def test_one_rule_selects_the_backend(monkeypatch):
    """Triton on CUDA, torch on the CPU; Triton by name on the CPU only under the interpreter."""
    assert kernels.select_backend("auto", "cuda") is triton_ops
    assert kernels.select_backend("auto", "cpu") is torch_ops
    assert kernels.select_backend("torch", "cuda") is torch_ops
    assert kernels.select_backend("triton", "cpu") is triton_ops  # TRITON_INTERPRET=1, set in conftest
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a GPU"):
        kernels.select_backend("triton", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.select_backend("cudnn", "cpu")
    calls = []  # the package-level functions follow the same rule
    monkeypatch.setattr(torch_ops, "store_kv", lambda *args: calls.append("torch"))
    kernels.store_kv(*[torch.zeros(1)] * 5)
    assert calls == ["torch"]


def test_engine_with_triton_backend_matches_hf(tiny_model):
    """End to end under the interpreter: the engine's greedy tokens equal HF generate's (fp32)."""
    from transformers import AutoModelForCausalLM

    from pagedchat import LLM, SamplingParams

    prompts = [[5, 80, 17, 42, 9, 100, 7], [61, 3, 3, 250, 14, 200, 33, 90, 12, 1, 77, 8, 150, 21, 64, 19, 30]]
    llm = LLM(model=tiny_model, dtype="float32", device="cpu", attention_backend="triton", block_size=8,
              max_num_batched_tokens=16)  # the longer prompt is prefilled in two chunks
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=6, do_sample=False)[0, len(prompt):]
        assert out.token_ids == expected.tolist()


def test_without_triton_auto_is_torch_and_asking_for_triton_says_what_to_install(monkeypatch):
    monkeypatch.setattr(kernels, "_have_triton", lambda: False)
    assert kernels.select_backend("auto", "cuda") is kernels.torch_ops
    with pytest.raises(ValueError, match=r"pip install 'pagedchat\[gpu\]'"):
        kernels.select_backend("triton", "cuda")
