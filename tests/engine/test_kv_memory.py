"""The KV pool reserves its bytes but takes memory as its blocks are written, as the OS hands calloc's pages
out at first touch: a 256 MB pool adds next to nothing to the process until it is used."""

from pathlib import Path

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
