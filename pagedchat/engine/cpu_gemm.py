"""The AVX2 matmul of cpu_gemm.c, built with the machine's C compiler at its first use and kept in the user
cache folder (one build per source, ~1 s), called through ctypes (which lets go of the GIL meanwhile)."""

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

SOURCE = Path(__file__).with_name("cpu_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
WEIGHT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
NEEDED_FLAGS = {"avx2", "fma", "f16c"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags known, so only the safe choices
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """`pagedchat_linear` from the built library; None where the CPU lacks AVX2/FMA/F16C or it cannot be built."""
    if not NEEDED_FLAGS <= cpu_flags():
        return None
    try:
        library = ctypes.CDLL(str(_built()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("the AVX2 matmul could not be built (%s); the layers use oneDNN instead", detail)
        return None
    fn = library.pagedchat_linear
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, p, ctypes.c_int, i64, p, p, ctypes.c_int]
    fn.restype = None
    return fn


def _built() -> Path:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    folder = platformdirs.user_cache_path("pagedchat", appauthor=False) / "native"
    path = folder / f"cpu_gemm-{digest}.so"
    if not path.exists():
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            raise OSError("no C compiler (cc or gcc) on PATH")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then moved: another process may load it
            built = Path(tmp) / path.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True,
                           text=True)
            os.replace(built, path)
    return path


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.dtype in WEIGHT_KINDS and weight.is_contiguous()
            and weight.shape[1] % 8 == 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias, in fp32, on the weight as it is; the caller checks `supports` and
    that `kernel()` is built."""
    x = x.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    (rows, depth), width = x.shape, weight.shape[0]
    y = torch.empty(rows, width)
    kernel()(x.data_ptr(), rows, depth, weight.data_ptr(), WEIGHT_KINDS[weight.dtype], width,
       None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y
