"""C kernels for the CPU, built with the machine's C compiler at their first use and kept in the user cache
folder (one build per source and flags, ~1 s), called through ctypes (which lets go of the GIL meanwhile)."""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import platformdirs
import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADERS = ["avx2.h", "avx512.h"]
# no contraction into FMAs where torch rounds a product before a sum (rotary, norms)
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
AVX2_CPU_FLAGS = {"avx2", "fma", "f16c"}
AVX512_BF16_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-ffp-contract=off", "-fopenmp",
                     "-shared", "-fPIC"]
AVX512_BF16_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
ISAS = {"avx2": (AVX2_CPU_FLAGS, AVX2_FLAGS), "avx512_bf16": (AVX512_BF16_CPU_FLAGS, AVX512_BF16_FLAGS),
        # any CPU: the compiler's default target (SSE2 on x86-64)
        "portable": (set(), ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"])}
KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the `kind` of avx2.h


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags known, so only the safe choices
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def function(name: str, symbol: str, argtypes: list, isa: str = "avx2") -> ctypes._CFuncPtr | None:
    """`symbol` (returning void) of `library(name, isa)`, or None where that is None."""
    built = library(name, isa)
    if built is None:
        return None
    fn = getattr(built, symbol)
    fn.argtypes = argtypes
    fn.restype = None
    return fn


@functools.cache
def library(name: str, isa: str = "avx2") -> ctypes.CDLL | None:
    """The library built for `isa` (a key of ISAS) from this folder's C file `name`; None where the CPU lacks
    that instruction set or it cannot be built."""
    needed, flags = ISAS[isa]
    if not needed <= cpu_flags():
        return None
    try:
        return ctypes.CDLL(str(_built(HERE / name, flags)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("%s could not be built (%s); torch's own ops stand in", name, detail)
        return None


def pointer(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data as a C pointer argument; None for NULL."""
    return None if tensor is None else tensor.data_ptr()


def _built(source: Path, flags: list[str]) -> Path:
    text = source.read_bytes() + b"".join((HERE / header).read_bytes() for header in HEADERS)
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    folder = platformdirs.user_cache_path("pagedchat", appauthor=False) / "native"
    path = folder / f"{source.stem}-{digest}.so"
    if not path.exists():
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            raise OSError("no C compiler (cc or gcc) on PATH")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then moved: another process may load it
            built = Path(tmp) / path.name
            subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True,
                           text=True)
            os.replace(built, path)
    return path
