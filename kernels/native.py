"""C kernels for the CPU, built with the machine's C compiler at their first use and kept in the user cache
folder (one build per source and flags, ~1 s), called through ctypes (which lets go of the GIL meanwhile)."""

import ctypes
import functools
import hashlib
import logging
import os
import re
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
        "portable": (set(), ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]),
        # AVX2 with the VNNI byte dot product (vpdpbusd) on 256-bit vectors: its EVEX form, or the VEX one
        "avx512_vnni": (AVX2_CPU_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
                        AVX2_FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"]),
        "avx_vnni": (AVX2_CPU_FLAGS | {"avx_vnni"}, AVX2_FLAGS + ["-mavxvnni"])}
KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the `kind` of avx2.h


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags known, so only the safe choices
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def function(name: str, symbol: str, isa: str = "avx2") -> "Kernel | None":
    """`symbol` of `library(name, isa)`, its argument and result types read from its prototype in the C file
    (declared once, there); None where the library is None."""
    built = library(name, isa)
    return None if built is None else Kernel(getattr(built, symbol), prototype(HERE / name, symbol))


class Kernel:
    """A C entry point called with its prototype's types (so ctypes refuses a wrong argument count or kind). One
    that returns int returns 0, or non-zero where it could not allocate its scratch memory: raised here."""

    def __init__(self, fn: ctypes._CFuncPtr, signature: tuple[type | None, list[type]]) -> None:
        fn.restype, fn.argtypes = signature
        self.fn = fn

    def __call__(self, *args) -> None:
        if self.fn(*args):
            raise MemoryError(f"{self.fn.__name__}: out of memory for its scratch buffers")


_C_TYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "double": ctypes.c_double}


@functools.cache
def prototype(source: Path, symbol: str) -> tuple[type | None, list[type]]:
    """(result, arguments) as ctypes types from `symbol`'s definition in `source`: a pointer of any kind is
    c_void_p, the scalars those of _C_TYPES; anything else is a ValueError when the kernel is first bound."""
    match = re.search(rf"^(\w+)\s+{symbol}\s*\(([^)]*)\)\s*{{", source.read_text(), re.M)
    if match is None:
        raise ValueError(f"{source.name} defines no {symbol}(...)")

    def ctype(declaration: str) -> type | None:
        words = declaration.replace("*", " * ").split()
        if "*" in words:
            return ctypes.c_void_p
        scalar = next((w for w in words if w in _C_TYPES), None)
        if scalar is None:
            raise ValueError(f"{source.name}: {symbol} has an argument of a type not bound here: {declaration!r}")
        return _C_TYPES[scalar]

    arguments = [a for a in match[2].split(",") if a.strip() and a.strip() != "void"]
    return ctype(match[1]), [ctype(a) for a in arguments]


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
        detail = getattr(exc, "stderr", None) or str(exc)
        log.warning("%s could not be built (%s); torch's own ops stand in", name, detail)
        _problems[name, isa] = next((line for line in detail.splitlines() if "error" in line), detail.strip())
        return None


_problems: dict[tuple[str, str], str] = {}


def problem(name: str, isa: str = "avx2") -> str | None:
    """Why `library(name, isa)` is None on a CPU that has the instruction set (one line), else None."""
    library(name, isa)
    return _problems.get((name, isa))


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
            raise OSError("no C compiler (cc or gcc) on PATH: install gcc")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then moved: another process may load it
            built = Path(tmp) / path.name
            subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True,
                           text=True)
            os.replace(built, path)
    return path
