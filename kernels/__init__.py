"""Paged attention: Triton kernels and a torch implementation with the same signatures.

Each backend module offers `store_kv`, `paged_attention` and `attention` (store a step's new K/V, then
attend, from an `AttentionMetadata` built once per step). `select_backend` is the one rule that picks a
backend: Triton on CUDA, torch on the CPU, unless asked for by name; Triton on the CPU needs
TRITON_INTERPRET=1 (tests: correct, ~100x too slow for live use). The package-level `store_kv` and
`paged_attention` follow the same rule for the device of their tensors.

`triton_ops` is imported on first use, not here: Triton reads TRITON_INTERPRET when a kernel is
defined, so importing this package must not define them before the caller had a chance to set it.
Triton itself is optional (the `gpu` extra; CUDA builds of torch bring their own): the torch path
never imports it, "auto" falls back to torch without it, and asking for it by name says how to get it.
"""

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

from . import torch_ops
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "select_backend", "store_kv", "torch_ops", "triton_ops"]

BACKENDS = ("auto", "torch", "triton")


def select_backend(backend: str, device_type: str) -> ModuleType:
    """The attention implementation for `backend` ("auto", "torch" or "triton") on this device type."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} ({', '.join(BACKENDS)})")
    if backend == "auto":
        backend = "triton" if device_type == "cuda" and _have_triton() else "torch"
    if backend == "torch":
        return torch_ops
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a GPU, or TRITON_INTERPRET=1 to run on the CPU (slowly)")
    if not _have_triton():
        raise ValueError("the triton backend needs the triton package, which is not installed: "
                         "pip install 'pagedchat[gpu]' (or use --backend torch)")
    return importlib.import_module(".triton_ops", __name__)


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are skipped."""
    select_backend("auto", key.device.type).store_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len positions) over its paged context."""
    return select_backend("auto", query.device.type).paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out, num_kv_splits)


def __getattr__(name: str) -> ModuleType:
    # `pagedchat.kernels.triton_ops` as an attribute, imported on first use
    if name == "triton_ops":
        return importlib.import_module(".triton_ops", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
