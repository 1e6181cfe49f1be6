"""The Triton paged-attention kernels on a GPU: correctness, the engine end to end, then speed.

    python bench/gpu_kernels.py        # on a CUDA machine, a few minutes

Needs only torch, triton and transformers (written against torch 2.11, triton 3.6,
transformers 5.17). The package travels as source, uninstalled: the repository root goes on
sys.path and kernels/ is registered as `pagedchat.kernels`, which is what installing it does.

1. correctness: the Triton kernels against the torch implementation run in float64 on the GPU,
   fp32 with IEEE dots (TF32 would miss the 1e-5 bound), fp16 and bf16, split-KV on and off;
2. engine_check(): the engine with the Triton backend against HF `generate`, greedy, fp32;
3. speed, bf16: paged_attention against torch SDPA on the same K/V gathered into contiguous
   tensors (the gather not timed), decode and prefill mixes; achieved bandwidth against the
   card's measured copy bandwidth (decode reads each K/V byte once: bandwidth is the limit).
"""

import importlib
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.modules.setdefault("pagedchat.kernels", importlib.import_module("kernels"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import torch_ops, triton_ops  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# the shape of Llama-3-8B's attention: 32 query heads over 8 KV heads of 128
BENCH_HEADS, BENCH_KV_HEADS, BENCH_HEAD_DIM, BENCH_BLOCK = 32, 8, 128, 16


def paged_batch(seq_lens: list[int], q_lens: list[int], num_q_heads: int, num_kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random K/V in blocks of a pool, each sequence's blocks scattered in shuffled order; the
    pool's spare block and the slots past each context hold NaN, as freed memory may."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    starts = [0, *torch.tensor(blocks_per_seq).cumsum(0).tolist()]
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = order[starts[s]:starts[s] + n]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    key_cache[order[-1]] = value_cache[order[-1]] = float("nan")
    for s, n in enumerate(seq_lens):
        last = block_tables[s, (n - 1) // block_size]
        key_cache[last, (n - 1) % block_size + 1:] = value_cache[last, (n - 1) % block_size + 1:] = float("nan")
    return dict(
        query=torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype),
        key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        scale=head_dim ** -0.5,
    )


def to_device(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def check_correctness(device: str = "cuda") -> None:
    """Every head_dim, block size, dtype and GQA ratio (pairwise), split-KV auto/off/forced, on a
    mixed batch: decode rows, whole prompts and chunks after a cached prefix, ragged up to 2k."""
    cases = [  # (head_dim, block_size, dtype, (Hq, Hkv), num_kv_splits)
        (64, 32, torch.float32, (8, 2), None), (64, 16, torch.float16, (2, 2), 1),
        (64, 8, torch.bfloat16, (9, 3), 3), (80, 32, torch.float16, (9, 3), 3),
        (80, 8, torch.float32, (2, 2), 1), (80, 16, torch.bfloat16, (8, 2), None),
        (96, 16, torch.float32, (9, 3), 1), (96, 8, torch.float16, (8, 2), 3),
        (96, 32, torch.bfloat16, (2, 2), None), (128, 32, torch.bfloat16, (8, 2), 1),
        (128, 16, torch.float32, (2, 2), 3), (128, 8, torch.float16, (9, 3), None),
    ]
    for head_dim, block_size, dtype, (num_q_heads, num_kv_heads), splits in cases:
        mixed = dict(seq_lens=[1, 3 * block_size, 2047, 300, 4 * block_size, 1305, 130],
                     q_lens=[1, 1, 1, 300, block_size, 123, 1])
        decode = dict(seq_lens=[7, 16, 1000, 2048], q_lens=[1, 1, 1, 1])  # the kernel's decode-only tiling
        for shape in (mixed, decode):
            batch = to_device(paged_batch(**shape, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                          head_dim=head_dim, block_size=block_size, dtype=dtype), device)
            reference = torch_ops.paged_attention(**{
                k: v.double() if k in ("query", "key_cache", "value_cache") else v for k, v in batch.items()})
            out = torch.full_like(batch["query"], float("nan"))
            triton_ops.paged_attention(**batch, out=out, num_kv_splits=splits)
            error = relative_error(out, reference)
            label = f"D={head_dim} block={block_size} {str(dtype)[6:]} Hq/Hkv={num_q_heads}/{num_kv_heads} " \
                    f"splits={splits} {'decode' if shape is decode else 'mixed'}"
            status = "ok" if error <= TOLERANCE[dtype] else "FAIL"
            print(f"  {status:4s} {label:58s} rel err {error:.1e}", flush=True)
            assert status == "ok", label


# ---------------------------------------------------------------------------------------------
# engine_check: the engine end to end on the GPU. The engine is written beside these kernels; its
# public API is DESIGN.md's (`LLM`, `SamplingParams`), used here and nothing deeper.
# ---------------------------------------------------------------------------------------------
def engine_check(device: str = "cuda") -> None:
    """Greedy tokens of the engine (Triton backend, fp32) equal HF generate's on a tiny random Llama."""
    try:
        from pagedchat import LLM, SamplingParams
    except ImportError as error:
        print(f"  skipped: the engine is not importable ({error})")
        return
    from transformers import AutoModelForCausalLM

    prompts = [[(7 * i + 3) % 250 + 2 for i in range(n)] for n in (5, 40, 130)]
    with tempfile.TemporaryDirectory() as folder:
        build_tiny_llama(Path(folder))
        llm = LLM(model=folder, dtype="float32", device=device, attention_backend="triton",
                  block_size=16, max_num_batched_tokens=64)  # the long prompt is prefilled in chunks
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt], device=device)
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   do_sample=False)[0, len(prompt):].tolist()
            status = "ok" if out.token_ids == expected else "FAIL"
            print(f"  {status:4s} prompt of {len(prompt):3d} tokens: engine {out.token_ids} hf {expected}")
            assert status == "ok"


def build_tiny_llama(folder: Path) -> None:
    """A random 2-layer Llama (GQA 4:1, head_dim 64) and a word-level tokenizer, as an HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = 256
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", bos_token="w1",
                            eos_token="w2").save_pretrained(folder)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.5)  # smaller weights emit one token forever
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


# ---------------------------------------------------------------------------------------------
# speed
# ---------------------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() / (ms * 1e-3)


def bench_batch(batch_size: int, context: int, q_len: int, device: str = "cuda") -> dict:
    """batch_size sequences of `context` tokens, each with its last q_len positions as queries."""
    blocks_per_seq = math.ceil(context / BENCH_BLOCK)
    num_blocks = batch_size * blocks_per_seq
    shape = (num_blocks, BENCH_BLOCK, BENCH_KV_HEADS, BENCH_HEAD_DIM)
    new = dict(dtype=torch.bfloat16, device=device)
    index = dict(dtype=torch.int32, device=device)
    return dict(
        query=torch.randn(batch_size * q_len, BENCH_HEADS, BENCH_HEAD_DIM, **new),
        key_cache=torch.randn(shape, **new),
        value_cache=torch.randn(shape, **new),
        block_tables=torch.randperm(num_blocks, device=device).to(torch.int32).view(batch_size, blocks_per_seq),
        seq_lens=torch.full((batch_size,), context, **index),
        query_start_loc=torch.arange(0, batch_size * q_len + 1, q_len, **index),
        scale=BENCH_HEAD_DIM ** -0.5,
    )


def sdpa_on_gathered(batch: dict, batch_size: int, context: int, q_len: int):
    """torch SDPA over the same K/V gathered into contiguous [B, Hkv, L, D]; returns the timed call."""
    tables = batch["block_tables"].long()

    def gather(cache):
        return cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    key, value = gather(batch["key_cache"]), gather(batch["value_cache"])
    query = batch["query"].view(batch_size, q_len, BENCH_HEADS, BENCH_HEAD_DIM).transpose(1, 2)
    mask = None
    if 1 < q_len < context:  # queries are the last q_len positions: causal, aligned bottom-right
        positions = torch.arange(context, device=key.device)
        mask = positions[None, :] <= positions[context - q_len:, None]

    def run():
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=batch["scale"],
                                              is_causal=q_len == context > 1, enable_gqa=True)

    return run


def time_case(label: str, batch_size: int, context: int, q_len: int, copy_bw: float) -> None:
    batch = bench_batch(batch_size, context, q_len)
    triton_ms = do_bench(lambda: triton_ops.paged_attention(**batch), warmup=10, rep=50)
    no_split = "" if q_len > 1 else \
        f"{do_bench(lambda: triton_ops.paged_attention(**batch, num_kv_splits=1), warmup=10, rep=50):9.3f}"
    sdpa = sdpa_on_gathered(batch, batch_size, context, q_len)
    sdpa_ms = do_bench(sdpa, warmup=10, rep=50)
    expected = sdpa().transpose(1, 2).reshape(batch["query"].shape)
    error = relative_error(triton_ops.paged_attention(**batch), expected)
    kv_bytes = 2 * batch_size * context * BENCH_KV_HEADS * BENCH_HEAD_DIM * 2
    io_bytes = kv_bytes + 2 * batch["query"].numel() * 2
    flops = 4 * batch_size * BENCH_HEADS * BENCH_HEAD_DIM * q_len * (context - (q_len - 1) / 2)
    speed = f"{io_bytes / triton_ms / 1e6:7.0f} GB/s {100 * io_bytes / triton_ms * 1e3 / copy_bw:4.0f}%" \
        if q_len == 1 else f"{flops / triton_ms / 1e9:7.1f} TFLOP/s  "
    print(f"{label:26s} {triton_ms:9.3f} {no_split:>9s} {speed:>19s} {sdpa_ms:9.3f} "
          f"{sdpa_ms / triton_ms:7.2f}x  {error:.0e}", flush=True)
    assert error <= 2e-2, f"{label}: Triton and SDPA disagree ({error:.1e})"


def time_kernels() -> None:
    copy_bw = copy_bandwidth()
    print(f"measured copy bandwidth {copy_bw / 1e9:.0f} GB/s; bf16, Hq={BENCH_HEADS} Hkv={BENCH_KV_HEADS} "
          f"D={BENCH_HEAD_DIM} block={BENCH_BLOCK}; ms per call (CUDA events, L2 flushed)")
    print(f"{'case':26s} {'triton':>9s} {'no-split':>9s} {'triton speed':>19s} {'sdpa':>9s} "
          f"{'sdpa/tri':>8s}  err")
    for batch_size in (1, 16, 64, 256):
        for context in (128, 1024, 8192, 32768):
            if batch_size * context <= 2 ** 21:  # 8 GiB of K/V, and as much again gathered for SDPA
                time_case(f"decode {batch_size:3d} x {context:5d}", batch_size, context, 1, copy_bw)
    for batch_size, length in ((1, 1024), (1, 8192), (1, 32768), (4, 4096), (16, 1024)):
        time_case(f"prefill {batch_size:2d} x {length:5d}", batch_size, length, length, copy_bw)
    for batch_size, context, chunk in ((1, 4096, 1024), (4, 16384, 512)):
        time_case(f"chunk {batch_size} x {chunk} after {context - chunk}", batch_size, context, chunk, copy_bw)
    mixed_time()


def mixed_time() -> None:
    """One launch for 63 decodes at 4k and a 1024-token chunk after 3k cached: the engine's mixed step."""
    decode, chunk = bench_batch(63, 4096, 1), bench_batch(1, 4096, 1024)
    offset = decode["key_cache"].shape[0]
    batch = dict(
        query=torch.cat([decode["query"], chunk["query"]]),
        key_cache=torch.cat([decode["key_cache"], chunk["key_cache"]]),
        value_cache=torch.cat([decode["value_cache"], chunk["value_cache"]]),
        block_tables=torch.cat([decode["block_tables"], chunk["block_tables"] + offset]),
        seq_lens=torch.cat([decode["seq_lens"], chunk["seq_lens"]]),
        query_start_loc=torch.cat([decode["query_start_loc"], chunk["query_start_loc"][1:] + 63]),
        scale=decode["scale"],
    )
    mixed_ms = do_bench(lambda: triton_ops.paged_attention(**batch), warmup=10, rep=50)
    apart_ms = do_bench(lambda: (triton_ops.paged_attention(**decode), triton_ops.paged_attention(**chunk)),
                        warmup=10, rep=50)
    print(f"mixed step, 63 decodes x 4096 + one 1024-token chunk after 3072: one launch {mixed_ms:.3f} ms, "
          f"as two launches {apart_ms:.3f} ms")


def main() -> None:
    assert torch.cuda.is_available(), "this script needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}, Python {sys.version.split()[0]}")
    sections = [("correctness on CUDA (Triton vs torch_ops in float64)", check_correctness),
                ("engine end to end (Triton backend, fp32, greedy) vs HF generate", engine_check),
                ("speed", time_kernels)]
    start = time.perf_counter()
    for title, run in sections:
        print(f"== {title}", flush=True)
        began = time.perf_counter()
        run()
        print(f"   ({time.perf_counter() - began:.0f} s, compiles included)", flush=True)
    print(f"all done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
