"""The products with GGUF-quantized weights (kernels/quant.py) at Llama-3.2-1B's shapes, against the memory's
read bandwidth and torch's products on the same weights.

    python -m bench.quant_kernels                    # 2 threads, all shapes, a few minutes
    python -m bench.quant_kernels --types Q4_K --rows 1 16

One chat's decode (1 row) streams every weight once a token, so its measure is the weight bytes read a
second against what the memory gives one sum over a large tensor (`read GB/s`). A batch (16 rows) should
cost clearly less than 16 single rows, since each weight block is read and unpacked once for all of them;
a prefill (256 rows) is bound by the integer dot products. Each time is the least of a few rounds' medians
(other jobs share the machine: see `median_seconds`), with random weights of valid blocks; x is fp32.

Peers, on the same weights dequantized: torch's bf16 F.linear (what the engine runs without these
kernels), and torch._weight_int8pack_mm (int8 weights, one scale a row) as the library's own
quantized product on the CPU.
"""

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from pagedchat.kernels import native, quant

# Llama-3.2-1B: hidden 2048, 8 KV heads of 64, intermediate 8192, vocabulary 128256 (tied embeddings)
SHAPES = {"q/o": (2048, 2048), "k/v": (512, 2048), "gate/up": (8192, 2048), "down": (2048, 8192),
          "lm head": (128256, 2048)}
ROWS_PER_SHAPE = {"lm head": (1, 16)}  # a prefill takes the lm head of its last row only
TYPES = ("Q4_K", "Q6_K", "Q8_0")
INT8PACK_ROWS = 16  # past a few rows it runs at 1-2 GFLOP/s on AVX2 machines: seconds a product


def random_weight(rng: np.random.Generator, ggml_type: GGMLQuantizationType, rows: int, depth: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] of valid blocks: random values, fp16 scales of a real model's sizes."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, depth // block, size), dtype=np.uint8)
    scales = [size - 2] if ggml_type == GGMLQuantizationType.Q6_K else [0]
    scales += [2] if ggml_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K) else []
    for offset in scales:
        values = rng.uniform(1e-3, 2e-2, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def median_seconds(fn: Callable[[], object], budget: float = 0.5, rounds: int = 5, least: int = 3,
                   most: int = 100) -> float:
    """The least of `rounds` medians, each of repeats for budget / rounds seconds: another job that takes a core
    for a while (a 2-thread call then waits out its time slice, ~16 ms) spoils a round, not the figure."""
    fn()
    medians = []
    for _ in range(rounds):
        times: list[float] = []
        spent = 0.0
        while len(times) < least or (spent < budget / rounds and len(times) < most):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            spent += times[-1]
        medians.append(statistics.median(times))
    return min(medians)


def read_bandwidth(gigabytes: float = 0.5) -> float:
    """GB/s that one sum over a large fp32 tensor reads at (the threads torch has)."""
    big = torch.ones(int(gigabytes * 1e9) // 4)
    return big.numel() * 4 / median_seconds(lambda: big.sum(), budget=3.0) / 1e9


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as int8 with one scale a row, for torch._weight_int8pack_mm."""
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", nargs="+", default=list(TYPES),
                        choices=[GGMLQuantizationType(t).name for t in quant.TYPES])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 256])
    parser.add_argument("--isas", nargs="+", default=quant.available_isas())
    parser.add_argument("--no-peers", action="store_true", help="only the quantized kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = " ".join(sorted(native.cpu_flags()))
    print(f"cpu flags: {flags}")
    print(f"threads {torch.get_num_threads()}; load average {' / '.join(f'{v:.1f}' for v in os.getloadavg())}; "
          f"kernels: {', '.join(args.isas)} (default {quant.isa()})")
    bandwidth = read_bandwidth()
    print(f"memory read bandwidth (torch sum over 0.5 GB fp32): {bandwidth:.1f} GB/s\n")
    print("| shape (N x K) | type | rows | kernel | ms | weight GB/s | of read bw | GFLOP/s | vs rows x 1-row |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        width, depth = SHAPES[shape]
        row_set = [r for r in args.rows if r in ROWS_PER_SHAPE.get(shape, args.rows)]
        peers = not args.no_peers
        for type_name in args.types:
            ggml_type = GGMLQuantizationType[type_name]
            weight = random_weight(rng, ggml_type, width, depth)
            gigabytes = weight.numel() / 1e9
            single: dict[str, float] = {}
            for rows in row_set:
                x = torch.randn(rows, depth)
                out = torch.empty(rows, width)
                for isa in args.isas:
                    seconds = median_seconds(lambda: quant.linear(x, weight, ggml_type, depth, out=out, isa=isa))
                    if rows == 1:
                        single[isa] = seconds
                    versus = f"{seconds / (rows * single[isa]):.2f}" if rows > 1 and isa in single else ""
                    print(f"| {shape} {width}x{depth} | {type_name} | {rows} | {isa} | {seconds * 1e3:.3f} | "
                          f"{gigabytes / seconds:.1f} | {gigabytes / seconds / bandwidth:.0%} | "
                          f"{2 * rows * width * depth / seconds / 1e9:.0f} | {versus} |")
            if not peers:
                continue
            # the peers multiply a dense copy of the first type's weights (their speed does not depend on the values)
            peers = False
            dense = torch.from_numpy(quants.dequantize(weight.numpy(), ggml_type))
            bf16 = dense.to(torch.bfloat16)
            packed, scale = int8_rows(dense)
            del dense
            for rows in row_set:
                x = torch.randn(rows, depth)
                xb = x.to(torch.bfloat16)
                seconds = median_seconds(lambda: F.linear(xb, bf16))
                print(f"| {shape} {width}x{depth} | bf16 copy | {rows} | torch F.linear | {seconds * 1e3:.3f} | "
                      f"{bf16.numel() * 2 / seconds / 1e9:.1f} | {bf16.numel() * 2 / seconds / 1e9 / bandwidth:.0%} | "
                      f"{2 * rows * width * depth / seconds / 1e9:.0f} | |")
                if rows > INT8PACK_ROWS:
                    continue
                try:
                    seconds = median_seconds(lambda: torch._weight_int8pack_mm(x, packed, scale))
                except RuntimeError as exc:  # not built for this CPU or dtype
                    print(f"| {shape} | int8 copy | {rows} | torch._weight_int8pack_mm | unavailable: {exc} |")
                    continue
                print(f"| {shape} {width}x{depth} | int8 copy | {rows} | torch._weight_int8pack_mm | "
                      f"{seconds * 1e3:.3f} | {packed.numel() / seconds / 1e9:.1f} | "
                      f"{packed.numel() / seconds / 1e9 / bandwidth:.0%} | "
                      f"{2 * rows * width * depth / seconds / 1e9:.0f} | |")
            del bf16, packed, scale
    print(f"\nload average at the end {' / '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
