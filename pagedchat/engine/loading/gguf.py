"""A GGUF file used as it is: its tensors are read where they lie in a memory map (a quantized matrix as its
rows of blocks, multiplied in place by kernels/cpu_quant.c), its config and tokenizer come from its metadata.

The header is read here rather than by `gguf.GGUFReader`, which builds a numpy view for each of the
~100,000 strings of a tokenizer's vocabulary and merges: 3.9 s for the default model's file on the 2-core
machines, where skipping them takes milliseconds. The config and the tokenizer need transformers' reading of
those fields; they are made once per file and kept in the user cache (a few MB), keyed by path, size and
mtime, so a second start reads nothing but the header and maps the tensors, and does not import transformers
(`tokenizer`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING
from unittest import mock

import numpy as np
import platformdirs
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedchat.engine.layers.quantized import Matrix, QuantizedWeight
from pagedchat.engine.loading import page_cache
from pagedchat.engine.loading.tokenizer import FileTokenizer, quiet_transformers, transformers_tokenizer
from pagedchat.engine.loading.tokenizer import save as save_tokenizer
from pagedchat.kernels import quant

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# general.architecture -> transformers' model_type, for the families pagedchat runs
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# llama.cpp's converter interleaves the two rotary halves of each head's q and k rows for these (it runs
# rotary on adjacent pairs there); Qwen's files keep transformers' order
PERMUTED_QK = frozenset({"llama"})
_PLAIN = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
          GGMLQuantizationType.BF16: torch.bfloat16}
# a copy made of a tensor whose type the kernels do not take: bf16, the dtype such models are published in;
# its rounding is far below the quantization steps the values come from
DEQUANTIZED_DTYPE = torch.bfloat16


class GgufError(ValueError):
    """A file that is not a GGUF pagedchat can read; str(e) says why in one line."""


# --- the header ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch's order: the GGUF's dims reversed, so a matrix is (N, K)
    ggml_type: int
    offset: int  # from the file's start
    nbytes: int


@dataclass(frozen=True, slots=True)
class Header:
    metadata: dict[str, object]  # scalars and strings; an array is its length
    tensors: dict[str, TensorInfo]
    file_size: int

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


# value type -> struct format; 8 (string) and 9 (array) are read apart
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: Path) -> Header:
    """The metadata and tensor table of a GGUF file, checked against the file's size. Read once per file (path,
    size, mtime) in a process: a start reads it to check the model, to size the KV pool and to load it, and a
    vocabulary's ~100,000 strings take tens of milliseconds to step over each time."""
    try:
        stat = os.stat(path)
        return _read_header(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    except (struct.error, ValueError, UnicodeDecodeError, OSError) as error:
        if isinstance(error, GgufError):
            raise
        raise GgufError(f"{type(error).__name__}: {error}") from error


@functools.lru_cache(maxsize=8)
def _read_header(path: str, size: int, mtime_ns: int) -> Header:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return _parse_header(buffer)


def _parse_header(buffer) -> Header:
    at = 0

    def take(fmt: str):
        nonlocal at
        values = struct.unpack_from("<" + fmt, buffer, at)
        at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal at
        length = take("Q")
        text = bytes(buffer[at:at + length]).decode("utf-8")
        at += length
        return text

    if bytes(buffer[:4]) != b"GGUF":
        raise GgufError("no GGUF magic at the file's start")
    at = 4
    version, tensor_count, kv_count = take("I"), take("Q"), take("Q")
    if version not in (2, 3):
        raise GgufError(f"GGUF version {version} (a big-endian file?) is not read here")
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        key, kind = string(), take("I")
        if kind == _STRING:
            metadata[key] = string()
        elif kind == _ARRAY:
            item_kind, count = take("I"), take("Q")
            metadata[key] = count
            if item_kind == _STRING:  # the vocabulary's strings: stepped over, one length at a time
                length = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    at += 8 + length(buffer, at)[0]
            elif item_kind in _SCALARS:
                at += count * struct.calcsize("<" + _SCALARS[item_kind])
            else:
                raise GgufError(f"unknown metadata array type {item_kind} under {key}")
        elif kind in _SCALARS:
            metadata[key] = take(_SCALARS[kind])
        else:
            raise GgufError(f"unknown metadata value type {kind} under {key}")
    infos = []
    for _ in range(tensor_count):
        name, dims = string(), take("I")
        shape = tuple(reversed([take("Q") for _ in range(dims)]))
        infos.append((name, shape, take("I"), take("Q")))
    alignment = metadata.get("general.alignment", 32)
    data_start = -(-at // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        if ggml_type not in GGML_QUANT_SIZES:
            raise GgufError(f"tensor {name} has an unknown type {ggml_type}")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        nbytes = int(np.prod(shape)) // block * block_bytes
        info = TensorInfo(name, shape, ggml_type, data_start + offset, nbytes)
        if info.offset + nbytes > len(buffer):
            raise GgufError(f"tensor {name} runs past the end of the file ({len(buffer)} bytes): truncated?")
        tensors[name] = info
    return Header(metadata, tensors, len(buffer))


def model_type(header: Header) -> str | None:
    """transformers' model_type of the file's architecture, None where pagedchat does not run it."""
    return ARCHITECTURES.get(header.architecture)


# --- config and tokenizer: made once, cached ------------------------------------------------------------------

CACHE_FORMAT = 2  # in the cache's key: 2 added tokenizer.save's files


def cache_dir(path: Path) -> Path:
    """Where the file's config and tokenizer are kept; the key covers path, size and mtime, so an edited file
    is read again."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return platformdirs.user_cache_path("pagedchat", appauthor=False) / "tokenizers" / f"{path.stem}-{key}"


def read_config(path: Path, header: Header) -> SimpleNamespace:
    """The fields the family's config class saved (`metadata_folder`), as attributes: what the engine reads of
    a config, without importing transformers (see `tokenizer`)."""
    return SimpleNamespace(**json.loads((metadata_folder(path, header) / "config.json").read_text()))


def load_tokenizer(path: Path, header: Header) -> FileTokenizer | PreTrainedTokenizerBase:
    """The file's tokenizer: `tokenizer.FileTokenizer` where it stands in for transformers' (any fast tokenizer
    that does not clean up spaces), else transformers' own."""
    folder = metadata_folder(path, header)
    tokenizer = FileTokenizer.load(folder)
    return tokenizer if tokenizer is not None else transformers_tokenizer(folder)


def metadata_folder(path: Path, header: Header) -> Path:
    """The folder of the file's config and tokenizer (`cache_dir`), written first if missing: what
    transformers' AutoConfig and AutoTokenizer read as they read a model folder."""
    target = cache_dir(path)
    if target.is_dir():  # only ever created by the rename below, so it is complete
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place, so an interrupted run leaves no half folder.
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_config_and_tokenizer(Path(path), header, scratch)
        try:
            scratch.rename(target)
        except OSError:  # another process finished the same folder first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _write_config_and_tokenizer(path: Path, header: Header, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_loading

    with quiet_transformers(), _read_gguf_once():
        try:
            fields = gguf_loading.load_gguf_checkpoint(str(path), return_tensors=False)["config"]
            fields.pop("_model_name_or_path", None)
            kind = fields.pop("model_type")
            # the file's own q/k shapes say the head size where its metadata does not (Qwen3's differs from
            # hidden / heads)
            if (k_proj := header.tensors.get("blk.0.attn_k.weight")) is not None:
                fields["head_dim"] = k_proj.shape[0] // fields["num_key_value_heads"]
            config = AutoConfig.for_model(kind, **fields)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as error:  # an unexpected tokenizer or field: transformers raises many kinds
            raise GgufError(f"its metadata cannot be read: {type(error).__name__}: {error}") from error
        config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        # as read back from the folder, as pagedchat read it before `tokenizer` stood in: a family's class sets up
        # more from a folder than from the GGUF (Qwen2's NFC normalizer)
        save_tokenizer(transformers_tokenizer(out), out)


@contextmanager
def _read_gguf_once() -> Iterator[None]:
    """transformers parses the whole GGUF header for the config and again for the tokenizer: once is enough."""
    import gguf

    cached_reader = functools.cache(gguf.GGUFReader)

    def reader(path, mode="r"):  # callers name the same file as str or Path, relative or not
        return cached_reader(str(Path(path).resolve()), mode)

    with mock.patch.object(gguf, "GGUFReader", reader):
        yield


# --- the weights ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dequantized:
    """A tensor of a type the kernels do not take, held as a dequantized copy: what it costs in memory."""

    name: str
    ggml_type: str
    file_bytes: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Generation:
    """What the engine reads of a model's generation config: the tokens that end a turn."""

    eos_token_id: list[int]


@dataclass(slots=True)
class GgufModel:
    """What the engine reads of a model, for a GGUF file: config, dtype (of the activations and the KV
    cache), device, generation_config; and the file's tensors by their GGUF names."""

    path: Path
    config: SimpleNamespace  # `read_config`
    generation_config: Generation
    dtype: torch.dtype
    device: torch.device
    tensors: dict[str, Matrix]
    in_place: bool  # quantized matrices multiplied in place; else every tensor is a plain one in `dtype`
    permuted_qk: bool  # q/k rows in llama.cpp's order (see PERMUTED_QK), to be read back in transformers'
    dequantized: list[Dequantized] = field(default_factory=list)

    @property
    def weight_types(self) -> list[str]:
        """The matrices' formats as held (a dequantized copy as BF16), most bytes first."""
        sizes: dict[str, int] = {}
        for tensor in self.tensors.values():
            if isinstance(tensor, QuantizedWeight):
                name, size = GGMLQuantizationType(tensor.ggml_type).name, tensor.data.numel()
            elif tensor.dim() == 2:
                name, size = _FORMAT_NAMES[tensor.dtype], tensor.numel() * tensor.element_size()
            else:
                continue
            sizes[name] = sizes.get(name, 0) + size
        return sorted(sizes, key=sizes.get, reverse=True)


_FORMAT_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def runs_in_place(device: torch.device) -> bool:
    """Whether a GGUF's quantized tensors are multiplied where they lie on this device (else dequantized)."""
    return device.type == "cpu" and quant.isa() is not None


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of a GGUF model's activations when `dtype` is asked for: fp32 where it runs in place, since its
    activations are a few rows of the hidden size and the kernels' products come out in fp32, which a
    half-precision stream would round once more. Its KV cache: `kv_cache_dtype`."""
    return torch.float32 if runs_in_place(device) else dtype


def kv_cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of a GGUF model's KV cache when `auto` is asked for: where it runs in place, fp16, llama.cpp's
    default cache type: half the bytes of an fp32 cache for the same tokens (a 1B model's 4,096 tokens hold
    128 MB, not 256), and a rounding (11 bits) far finer than its products' 8-bit activations; else the dtype
    it computes in."""
    return torch.float16 if runs_in_place(device) else compute_dtype(dtype, device)


def open_model(path: Path, dtype: torch.dtype, device: torch.device
               ) -> tuple[GgufModel, FileTokenizer | PreTrainedTokenizerBase]:
    """The file's tensors over a memory map (`page_cache.map_file`), with its config and tokenizer.

    Where it runs in place (`runs_in_place`), every tensor of `quant.TYPES` stays the file's bytes, in a model
    that computes in `compute_dtype`; tensors of other types are dequantized once to bf16
    (`GgufModel.dequantized` lists them). Elsewhere (a GPU, no C compiler) every tensor is dequantized to
    `dtype` on `device`."""
    header = read_header(path)
    config = read_config(path, header)
    tokenizer = load_tokenizer(path, header)
    eos = {getattr(config, "eos_token_id", None)} - {None}
    # a chat model's turn may end on another token than its eos (Llama 3's <|eot_id|>)
    eos |= {header.metadata[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if key in header.metadata}
    generation = Generation(sorted(eos))
    in_place = runs_in_place(device)
    permuted = header.architecture in PERMUTED_QK
    file = page_cache.map_file(path, cache_dir(path) / "pages-stay-small")  # cache_dir: made by read_config
    tensors: dict[str, Matrix] = {}
    dequantized = []
    for info in header.tensors.values():
        raw = file[info.offset:info.offset + info.nbytes]
        if in_place and info.ggml_type in quant.TYPES and len(info.shape) == 2:
            rows = info.shape[0]
            tensors[info.name] = QuantizedWeight(torch.from_numpy(raw.reshape(rows, -1)), info.ggml_type, info.shape)
        elif info.ggml_type in _PLAIN and in_place:
            tensor = torch.from_numpy(raw).view(_PLAIN[info.ggml_type]).view(info.shape)
            tensors[info.name] = tensor if tensor.dim() == 2 else tensor.float()  # vectors: norms and biases
        else:
            tensor = _dequantize(raw, info)
            if not in_place and permuted and _is_qk(info.name):
                tensor = _unpermute_rows(tensor, config, info.name)
            if in_place:
                tensor = tensor.to(DEQUANTIZED_DTYPE) if tensor.dim() == 2 else tensor
                dequantized.append(Dequantized(info.name, GGMLQuantizationType(info.ggml_type).name, info.nbytes,
                                               tensor.numel() * tensor.element_size()))
            else:
                tensor = tensor.to(device=device, dtype=dtype)
            tensors[info.name] = tensor
    if dequantized:
        log.warning("%s: %d tensors of types the kernels do not take (%s) dequantized to bf16: +%.0f MiB",
                    Path(path).name, len(dequantized), "/".join(sorted({d.ggml_type for d in dequantized})),
                    sum(d.bytes for d in dequantized) / 2**20)
    model = GgufModel(Path(path), config, generation, compute_dtype(dtype, device), device, tensors,
                      in_place, permuted and in_place, dequantized)
    return model, tokenizer


def _dequantize(raw: np.ndarray, info: TensorInfo) -> torch.Tensor:
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(info.ggml_type)
    if kind in _PLAIN:
        return torch.from_numpy(raw.copy()).view(_PLAIN[kind]).view(info.shape).float()
    rows = int(np.prod(info.shape[:-1]))
    return torch.from_numpy(dequantize(raw.reshape(rows, -1), kind)).view(info.shape)


def _is_qk(name: str) -> bool:
    return name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_q.bias", ".attn_k.bias"))


def qk_order(heads: int, head_dim: int) -> torch.Tensor:
    """For each of transformers' q (or k) rows, the row of a llama.cpp-converted file that holds it: within a
    head, llama.cpp's row 2i + j is transformers' row j * head_dim / 2 + i."""
    half = head_dim // 2
    within = (2 * torch.arange(half)[None, :] + torch.arange(2)[:, None]).flatten()
    return (torch.arange(heads)[:, None] * head_dim + within[None, :]).flatten()


def _unpermute_rows(tensor: torch.Tensor, config: SimpleNamespace, name: str) -> torch.Tensor:
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
    return tensor[qk_order(heads, tensor.shape[0] // heads)]


def gguf_weights_bytes(path: Path) -> int:
    """The memory a GGUF's weights take once loaded here: its tensors' bytes (mapped), plus the dequantized
    copies of tensors of types the kernels do not take."""
    header = read_header(path)
    total = 0
    for info in header.tensors.values():
        total += info.nbytes
        if info.ggml_type not in quant.TYPES and info.ggml_type not in _PLAIN:
            total += int(np.prod(info.shape)) * DEQUANTIZED_DTYPE.itemsize
    return total
