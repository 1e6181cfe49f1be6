"""A GGUF mapped so that its pages can lie in the page cache as 2 MiB folios.

A decode of one chat streams every weight once a token; the kernels read a file's weights faster where its
cached pages are 2 MiB folios (each physically contiguous) than where they are the small ones that an ordinary
mapping's faults read in, as another program's or an older pagedchat's (bench/RESULTS.md, "Weights in 2 MiB
folios"). The kernel builds such folios when it reads a file in through a mapping advised MADV_HUGEPAGE (Linux
6.x on a filesystem with large folios, ext4 among them), but keeps the folios it already holds: so the first
load of a file in a boot drops its cached pages first (only clean pages that no process maps go), and the
model's first steps read them back through the mapping. A marker beside the file's tokenizer cache holds the boot's id, so that later loads of the same
boot keep what is cached, whatever shape it took.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def map_file(path: Path, marker: Path) -> np.ndarray:
    """The file's bytes, mapped private (writable for torch, never written) and advised MADV_HUGEPAGE where
    the platform has it; its cached pages dropped first where `first_load_this_boot(marker)`."""
    with open(path, "rb") as file:
        if hasattr(os, "posix_fadvise") and first_load_this_boot(marker):
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # EINVAL from a kernel built without transparent huge pages
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buffer, dtype=np.uint8)


def first_load_this_boot(marker: Path) -> bool:
    """Whether the file whose marker this is was not yet loaded since the machine booted, and huge pages are
    on (`always` or `madvise`): then the marker is written. False wherever the boot's id, the setting or the
    marker cannot be read or written, so that a load never drops the pages twice in a boot."""
    try:
        boot = BOOT_ID.read_text().strip()
        if "[never]" in THP_ENABLED.read_text() or (marker.is_file() and marker.read_text() == boot):
            return False
        marker.write_text(boot)
    except OSError:
        return False
    return True
