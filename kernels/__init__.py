"""Paged attention: Triton kernels and a torch implementation with the same signatures.

`store_kv` and `paged_attention` dispatch per call: to the Triton kernels for CUDA tensors or when
TRITON_INTERPRET=1 is set (tests on the CPU), else to the torch implementation. An engine that
picks a backend explicitly uses `torch_ops` or `triton_ops` directly.

`triton_ops` is imported on first use, not here: Triton reads TRITON_INTERPRET when a kernel is
defined, so importing this package must not define them before the caller had a chance to set it.
"""

import importlib
import os
from types import ModuleType

import torch

from . import torch_ops

__all__ = ["paged_attention", "store_kv", "torch_ops", "triton_ops"]


def _backend(tensor: torch.Tensor) -> ModuleType:
    if tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return importlib.import_module(".triton_ops", __name__)
    return torch_ops


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are skipped."""
    _backend(key).store_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len positions) over its paged context."""
    return _backend(query).paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                           query_start_loc, scale, out, num_kv_splits)


def __getattr__(name: str) -> ModuleType:
    # `pagedchat.kernels.triton_ops` as an attribute, imported on first use
    if name == "triton_ops":
        return importlib.import_module(".triton_ops", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
