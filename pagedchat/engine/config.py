"""One engine config, as vLLM keeps one for its CLI and its `LLM`: what a user asks for (`EngineArgs`: `LLM`'s
keywords, which the CLI's flags fill) resolved once into what the engine runs (`ResolvedConfig`), with every
check inside `resolve`, and all of them done before any weight loads. The CLI, `LLM` and `serve` all go through
it, so a pool that cannot fit is refused with the same line wherever it was asked for.

This module imports nothing heavy until `resolve` runs, so `pagedchat --help` can read its defaults."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedchat.engine.llm_engine import EngineConfig

DEFAULT_NUM_KV_BLOCKS = 512
# vLLM's `kv_cache_dtype` values taken here: auto is the dtype the model computes in (bf16), or fp16 for a GGUF
# run in place (llama.cpp's cache type: gguf.kv_cache_dtype); int8 and fp8 (e4m3) are 8-bit caches with a scale
# per slot and head (kernels/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")
# Memory left over for everything else once a pool the user sized and the weights are in: activations, the
# tokenizer, the app, torch's own allocations and the rest of the machine.
MEMORY_HEADROOM = 2 * 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """Engine arguments that cannot work together here; str(e) is one line that says what to change."""


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like '256MiB', '2GB' or '1TiB' (KB, MB, GB, TB are powers of 10)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", size.lower())
    if not match:
        raise ConfigError(f"not a size: {size!r} (use e.g. 256MiB or 2GB)")
    return int(float(match[1]) * _UNITS[match[2] or ""])


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model: str | os.PathLike | None = None  # None: the default model
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    num_threads: int | None = None
    compile: bool | None = None
    kv_cache_dtype: str = "auto"

    def resolve(self, *, progress: bool = True) -> ResolvedConfig:
        """Every value decided and checked, the model found (installed first if it is the default and missing),
        nothing loaded yet. Raises ModelError or ConfigError, each one line."""
        from pagedchat.engine.llm_engine import EngineConfig
        from pagedchat.engine.loading import gguf, loader
        from pagedchat.engine.worker.compiled_decode import compiling_by_default
        from pagedchat.engine.worker.model_runner import KVLayout
        from pagedchat.kernels import kv_quant, select_backend

        device = loader.resolve_device(self.device)
        dtype = loader.resolve_dtype(self.dtype, device)
        try:
            attention_ops = select_backend(self.attention_backend, device.type)
        except ValueError as error:
            raise ConfigError(str(error)) from error
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError("give num_kv_blocks (--num-blocks) or kv_cache_memory (--kv-memory), not both")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r} (--kv-cache-dtype): choose one of "
                              f"{', '.join(KV_CACHE_DTYPES)}")
        path = loader.resolve_model(self.model, progress=progress)
        auto_cache_dtype = dtype
        if loader.is_gguf(path):  # a GGUF's activations are in the dtype it computes in, its KV cache in its own
            dtype, auto_cache_dtype = gguf.compute_dtype(dtype, device), gguf.kv_cache_dtype(dtype, device)
        model_config = loader.check_model(path, self.max_model_len)
        cache_dtype = auto_cache_dtype if self.kv_cache_dtype == "auto" else kv_quant.CACHE_DTYPES[self.kv_cache_dtype]
        bytes_per_block = KVLayout.of(model_config).bytes_per_block(self.block_size, cache_dtype)
        num_blocks = self._pool_blocks(bytes_per_block)
        weights_bytes = loader.weights_bytes(path, dtype)
        self._check_memory(num_blocks, num_blocks * bytes_per_block, weights_bytes, _available_memory(device),
                           device.type)
        context = loader.model_context_len(model_config, self.max_model_len)
        pool_tokens = num_blocks * self.block_size
        if self.max_model_len is None:
            context = min(context, pool_tokens)
        elif self.max_model_len > pool_tokens:
            raise ConfigError(f"max_model_len {self.max_model_len} (--max-model-len) does not fit the pool of "
                              f"{num_blocks} blocks x {self.block_size} = {pool_tokens} tokens")
        engine = EngineConfig(
            num_kv_blocks=num_blocks, max_model_len=context, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching, num_threads=self.num_threads,
            compile=compiling_by_default() if self.compile is None else self.compile, kv_cache_dtype=cache_dtype,
            weights_bytes=weights_bytes)
        return ResolvedConfig(self, Path(path), model_config, device, dtype, attention_ops, engine, bytes_per_block,
                              weights_bytes)

    def _pool_blocks(self, bytes_per_block: int) -> int:
        if self.kv_cache_memory is None:
            return DEFAULT_NUM_KV_BLOCKS if self.num_kv_blocks is None else self.num_kv_blocks
        num_blocks = parse_size(self.kv_cache_memory) // bytes_per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory {self.kv_cache_memory} (--kv-memory) is less than one KV block "
                              f"({bytes_per_block} bytes)")
        return num_blocks

    def _check_memory(self, num_blocks: int, pool_bytes: int, weights_bytes: int, available: int | None,
                      where: str) -> None:
        """Refuse a pool the device cannot hold, naming what sized it. A pool the user sized must fit beside the
        weights with MEMORY_HEADROOM to spare, since a pool that only just fits makes the machine swap; the
        small default pool need only fit itself."""
        if available is None:  # not known here: let the engine find out
            return
        if self.kv_cache_memory is not None:
            asked, fix = f"kv_cache_memory {self.kv_cache_memory} (--kv-memory)", "ask for a smaller kv_cache_memory"
        elif self.num_kv_blocks is not None:
            asked, fix = f"num_kv_blocks {self.num_kv_blocks} (--num-blocks)", "ask for fewer num_kv_blocks"
        elif pool_bytes > available:
            raise ConfigError(f"the default pool of {num_blocks} blocks needs {_mib(pool_bytes)} MiB but only "
                              f"{_mib(available)} MiB are free on {where}: ask for fewer num_kv_blocks (--num-blocks)")
        else:
            return
        needed = pool_bytes + weights_bytes + MEMORY_HEADROOM
        if needed > available:
            raise ConfigError(f"{asked} is too large: a pool of {num_blocks} blocks ({_mib(pool_bytes)} MiB) + the "
                              f"model's weights ({_mib(weights_bytes)} MiB) + {_mib(MEMORY_HEADROOM)} MiB to spare "
                              f"need {_mib(needed)} MiB, but only {_mib(available)} MiB are free on {where}: {fix}")


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    args: EngineArgs
    model_path: Path  # the folder or .gguf file that loads
    model_config: Any  # transformers' PretrainedConfig
    device: torch.device
    dtype: torch.dtype
    attention_ops: ModuleType
    engine: EngineConfig
    bytes_per_block: int  # all layers' K and V of one block, an 8-bit cache's scales included
    weights_bytes: int  # the weights in memory once loaded

    @property
    def pool_bytes(self) -> int:
        return self.engine.num_kv_blocks * self.bytes_per_block


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f}"


def _available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    try:  # MemAvailable counts reclaimable page cache too, unlike the free pages sysconf gives
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:  # not Linux: let the engine find out
        return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None
