"""Decode attention by kernels/cpu_attention.c as a decode step meets it: every sequence's K/V in a pool far
larger than the CPU's caches (a layer's blocks were last read a whole step ago), on shuffled blocks, fp32
queries over an fp16 cache (what a GGUF runs). The measure is the K/V bytes read a second, at Llama-3.2-1B's
heads (32 query heads, 8 KV heads of 64) and the default model's (9 and 3).

    python -m bench.attention_kernel
    git show REV:kernels/cpu_attention.c > /tmp/old.c
    python -m bench.attention_kernel --against /tmp/old.c    # the two builds, alternating

`--against` builds another cpu_attention.c (with this checkout's headers) and times it in the same process,
the two calls alternating over the same pools: on a machine that other jobs share, only such a pair compares.
Each time is the best of `--rounds` calls."""

import argparse
import ctypes
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Section, Table, start, stopwatch
from pagedchat.kernels import cpu_attention, native

SYMBOL = "pagedchat_decode_attention"
HEAD_DIM, BLOCK_SIZE = 64, 16
# (sequences, tokens each, query heads, KV heads)
CASES = [(1, 128, 32, 8), (1, 4096, 32, 8), (4, 2048, 32, 8), (16, 128, 32, 8), (16, 1024, 32, 8),
         (16, 512, 9, 3)]
POOL_BYTES = 128 << 20  # the pools cycled through, together: past any L3 of these machines


def build(source: Path) -> native.Kernel:
    """cpu_attention.c's entry point built from `source`, beside a copy of this checkout's headers."""
    with tempfile.TemporaryDirectory() as folder:  # the library is kept in the user cache, by its sources' hash
        copy = Path(folder) / "cpu_attention.c"
        shutil.copy(source, copy)
        for header in native.HEADERS:
            shutil.copy(native.HERE / header, folder)
        built = ctypes.CDLL(str(native._built(copy, native.AVX2_FLAGS)))
        return native.Kernel(getattr(built, SYMBOL), native.prototype(copy, SYMBOL))


def time_case(kernels: dict[str, native.Kernel], seqs: int, tokens: int, heads: int, kv_heads: int,
              rounds: int) -> dict[str, float]:
    """Best seconds of a call for each kernel, alternating, each call over the next pool of the cycle."""
    blocks = seqs * -(-tokens // BLOCK_SIZE)
    pool_bytes = 2 * blocks * BLOCK_SIZE * kv_heads * HEAD_DIM * 2
    pools = []
    for _ in range(max(2, -(-POOL_BYTES // pool_bytes))):
        caches = [torch.randn(blocks, BLOCK_SIZE, kv_heads, HEAD_DIM).half() for _ in range(2)]
        pools.append((*caches, torch.randperm(blocks, dtype=torch.int32).view(seqs, -1).contiguous()))
    query, out = torch.randn(seqs, heads, HEAD_DIM), torch.empty(seqs, heads, HEAD_DIM)
    rows, lens = torch.arange(seqs), torch.full((seqs,), tokens, dtype=torch.int32)
    best = dict.fromkeys(kernels, float("inf"))
    for call in range(rounds * len(kernels)):
        name = list(kernels)[call % len(kernels)]
        key_cache, value_cache, tables = pools[call % len(pools)]
        started = time.perf_counter()
        kernels[name](query.data_ptr(), query.stride(0), rows.data_ptr(), key_cache.data_ptr(),
                      value_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), seqs, heads,
                      kv_heads, HEAD_DIM, BLOCK_SIZE, native.KINDS[torch.float32], native.KINDS[torch.float16],
                      HEAD_DIM ** -0.5, out.data_ptr(), out.stride(0), None, 0, None, 0, None,
                      torch.get_num_threads())
        best[name] = min(best[name], time.perf_counter() - started)
    return best


def attention_kernel_section(against: Path | None, rounds: int) -> Section:
    kernels = {"this checkout": cpu_attention.kernel()}
    if against is not None:
        kernels[str(against)] = build(against)
    rows = []
    with stopwatch() as t:
        for seqs, tokens, heads, kv_heads in CASES:
            best = time_case(kernels, seqs, tokens, heads, kv_heads, rounds)
            kv_bytes = 2 * seqs * tokens * kv_heads * HEAD_DIM * 2
            row = [seqs, tokens, f"{heads} / {kv_heads}"]
            for name in kernels:
                row += [best[name] * 1e3, kv_bytes / best[name] / 1e9]
            if against is not None:
                row.append(f"{best[str(against)] / best['this checkout']:.2f}x")
            rows.append(row)
    headers = ["sequences", "tokens each", "heads (q / KV)"]
    for name in kernels:
        headers += [f"{name}: ms", "GB/s"]
    headers += ["speedup"] if against is not None else []
    return Section("Decode attention kernel (cpu_attention.c)",
                   settings=[f"fp32 queries over an fp16 cache, head size {HEAD_DIM}, blocks of {BLOCK_SIZE} "
                             f"shuffled, pools of {POOL_BYTES >> 20} MB in all cycled; {torch.get_num_threads()} "
                             f"threads; best of {rounds} calls" + (", the builds alternating" if against else "")],
                   tables=[Table(headers, rows)], seconds=t.wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, the kernel's")
    parser.add_argument("--against", type=Path, default=None, help="another cpu_attention.c to time beside this one")
    parser.add_argument("--rounds", type=int, default=40)
    args = start(parser)
    if cpu_attention.kernel() is None:
        raise SystemExit("cpu_attention.c is not built on this machine (it needs AVX2)")
    print(attention_kernel_section(args.against, args.rounds).markdown())


if __name__ == "__main__":
    main()
