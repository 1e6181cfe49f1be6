"""The KV pool reserves its bytes but takes memory as its blocks are written, as the OS hands calloc's pages
out at first touch: a 256 MB pool adds next to nothing to the process until it is used. And an engine's process
gives a large buffer's pages back when it frees it (runtime/memory.py)."""

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedchat.engine.worker.model_runner import untouched_zeros


def resident_mb() -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def test_a_pool_takes_memory_as_its_blocks_are_written():
    before = resident_mb()
    pool = untouched_zeros((1024, 16, 64, 64), torch.bfloat16, torch.device("cpu"))  # 128 MiB
    assert pool.shape == (1024, 16, 64, 64) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert resident_mb() - before < 16
    values = torch.randn(64, 16, 64, 64).to(torch.bfloat16)
    pool[100:164] = values  # 8 MiB written
    assert torch.equal(pool[100:164], values)
    assert torch.count_nonzero(pool[:100]) == 0 and torch.count_nonzero(pool[164:]) == 0
    assert resident_mb() - before < 16 + 8 + 128 / 2  # reading zeros maps no memory of the pool's own


# glibc raises its mapping threshold past a mapped buffer it frees; a buffer of 4 MB then comes from the heap and
# stays resident after it is freed (a small one allocated after it keeps the heap from shrinking)
FREED_BUFFER = """
import ctypes, sys
from pathlib import Path

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if len(sys.argv) > 1:
    from pagedchat import LLM
    LLM(model=sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=8, max_model_len=64)


def resident_kb():
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(line.split()[1])


mapped = libc.malloc(8 << 20)
ctypes.memset(mapped, 1, 8 << 20)
libc.free(mapped)
before = resident_kb()
buffer = libc.malloc(4 << 20)
ctypes.memset(buffer, 1, 4 << 20)
pin = libc.malloc(64)
libc.free(buffer)
print(resident_kb() - before)
"""


@pytest.mark.skipif(getattr(ctypes.CDLL(None), "mallopt", None) is None, reason="not glibc's malloc")
def test_an_engines_process_gives_a_freed_large_buffer_back_to_the_os(tiny_model):
    def kept_kb(*model: Path) -> int:
        command = [sys.executable, "-P", "-c", FREED_BUFFER, *map(str, model)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
        return int(done.stdout.split()[-1])

    assert kept_kb() >= 3 * 1024  # glibc's own behaviour, without an engine: the buffer's pages stay
    assert kept_kb(tiny_model) < 1024
