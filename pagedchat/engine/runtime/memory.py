"""A freed large buffer goes back to the OS. glibc's malloc maps an allocation of more than its threshold (128 KB
at start) and unmaps it when freed, but raises the threshold to the size of each mapped buffer it frees (up to
32 MB): after the first prefill, a step's activations of a few MB come from the heap, whose pages stay with the
process once freed, so its resident memory grows with the largest batches it has seen. Setting the threshold turns
that raising off."""

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD_BYTES = 1 << 20  # a decode step's activations stay below it (reused from the heap), a prefill's go above


@functools.cache
def return_large_buffers() -> bool:
    """Fix malloc's mapping threshold at 1 MB for this process; False where the C library has no such setting."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
