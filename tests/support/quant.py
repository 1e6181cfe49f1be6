"""Random GGUF-quantized matrices for the kernels' tests."""

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


def random_weight(rng: np.random.Generator, ggml_type: int, rows: int, depth: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid blocks: random bytes for the quantized values and sub-block scales,
    finite fp16 scales (d, and dmin or Q4_1's m) of the sizes real models have."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, depth // block, size), dtype=np.uint8)

    def put(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)

    put(size - 2 if ggml_type == GGMLQuantizationType.Q6_K else 0, 1e-3, 2e-2)  # d
    if ggml_type == GGMLQuantizationType.Q4_1:
        put(2, -0.2, 0.2)  # m
    elif ggml_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        put(2, 1e-3, 2e-2)  # dmin
    return raw.reshape(rows, -1)
