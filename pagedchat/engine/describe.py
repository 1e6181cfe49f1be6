"""What a model holds in memory and which kernels multiply its weights on this CPU, told without loading any
weights: `pagedchat --help` says it of the default model (its GGUF's header read), `pagedchat --version` of the
kernels (built once, as at a model's load)."""

import math
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from pagedchat.engine.layers.plan import plan_for
from pagedchat.engine.loading import gguf, loader
from pagedchat.kernels import quant

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# the byte product each of cpu_quant.c's builds multiplies with
_INSTRUCTIONS = {"avx512_vnni": "vpdpbusd", "avx_vnni": "vpdpbusd", "avx2": "maddubs", "portable": "portable C"}
_PLAIN = ("F32", "F16", "BF16")


def gguf_memory(path: Path, block_size: int, num_blocks: int) -> str:
    """What a GGUF holds once loaded here, from its header alone, e.g. 'Q4_1/Q8_0 GGUF, 97 MB mapped, beside a KV
    pool of 189 MB: 512 blocks of 16 tokens in fp16'."""
    header = gguf.read_header(path)
    device = loader.resolve_device("auto")
    asked = loader.resolve_dtype("auto", device)
    dtype, cache_dtype = gguf.compute_dtype(asked, device), gguf.kv_cache_dtype(asked, device)
    sizes: dict[str, int] = {}
    for info in header.tensors.values():
        if len(info.shape) == 2:
            name = GGMLQuantizationType(info.ggml_type).name
            sizes[name] = sizes.get(name, 0) + info.nbytes
    weights = f"{'/'.join(sorted(sizes, key=sizes.get, reverse=True))} GGUF"
    if gguf.runs_in_place(device):
        mapped = sum(info.nbytes for info in header.tensors.values())
        copies = gguf.gguf_weights_bytes(path) - mapped
        weights += f", {_mb(mapped)} mapped" + (f" and {_mb(copies)} of bf16 copies" if copies else "")
    else:
        values = sum(math.prod(info.shape) for info in header.tensors.values())
        weights += f", dequantized to {_mb(values * dtype.itemsize)} of {_DTYPE_NAMES[dtype]} at load"
    pool = num_blocks * block_size * _kv_bytes_per_token(header, cache_dtype)
    return (f"{weights}, beside a KV pool of {_mb(pool)}: {num_blocks} blocks of {block_size} tokens in "
            f"{_DTYPE_NAMES[cache_dtype]}")


def kernels_here() -> str:
    """Which kernels multiply each kind of weights on this CPU, and attend: a few lines, as the kernel plans that
    a model's load would make say it."""
    cpu = torch.device("cpu")
    lines = []
    if gguf.runs_in_place(cpu):
        types = tuple(GGMLQuantizationType(t).name for t in sorted(quant.TYPES)) + _PLAIN
        isas = quant.available_isas()
        builds = f"  cpu_quant.c on {isas[0]} ({_INSTRUCTIONS[isas[0]]}); this CPU runs its builds for {', '.join(isas)}"
        lines += [f"GGUF: {plan_for(torch.float32, cpu, 'torch', types).describe()}", builds,
                  "  other GGUF types (IQ*, Q2_K, Q3_K, ...): dequantized to bf16 copies at load"]
    else:
        lines.append(f"GGUF: dequantized at load ({quant.SOURCE} could not be built here)")
    lines.append(f"Hugging Face folder: {plan_for(torch.bfloat16, cpu, 'torch').describe()}")
    return "\n".join(lines)


def _kv_bytes_per_token(header: gguf.Header, dtype: torch.dtype) -> int:
    """All layers' K and V of one token, from the GGUF's own fields, as llama.cpp sizes its cache."""
    field = {key.removeprefix(f"{header.architecture}."): value for key, value in header.metadata.items()}
    heads = field["attention.head_count"]
    head_dim = field.get("attention.key_length") or field["embedding_length"] // heads
    return 2 * field["block_count"] * field.get("attention.head_count_kv", heads) * head_dim * dtype.itemsize


def _mb(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"
