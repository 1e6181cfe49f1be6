"""A GGUF mapped so that its pages lie in the page cache as 2 MiB folios where the kernel can keep them so.

A decode of one chat streams every weight once a token; the kernels read a file's weights faster where its
cached pages are 2 MiB folios (each physically contiguous) than where they are the small ones that an ordinary
mapping's faults read in, as another program's or an older pagedchat's (bench/RESULTS.md, "Weights in 2 MiB
folios"). The kernel builds such folios when it reads a file in through a mapping advised MADV_HUGEPAGE (Linux
6.x on a filesystem with large folios, ext4 among them), but keeps the folios it already holds. So a load looks
at one page of the file through its mapping (`in_small_pages`); where it is small, it drops the file's cached
pages (only clean pages that no process maps go) and looks again: the model's first steps read the rest back
the same way. A marker beside the file's tokenizer cache says, for the current boot, where dropping them did not
help (a filesystem without large folios, another program holding the file mapped), so that such a file is not
read from disk again at every start.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS = Path("/proc/self/smaps")
HUGE = 2 << 20
UNHELPED = "no larger pages"  # the marker's word after the boot's id


def map_file(path: Path, marker: Path) -> np.ndarray:
    """The file's bytes, mapped private (writable for torch, never written) and advised MADV_HUGEPAGE where
    the platform has it; its cached pages dropped where they are small and `may_drop(marker)`."""
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        array = np.frombuffer(buffer, dtype=np.uint8)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # EINVAL from a kernel built without transparent huge pages
                buffer.madvise(mmap.MADV_HUGEPAGE)
        if hasattr(os, "posix_fadvise") and in_small_pages(array) and may_drop(marker):
            buffer.madvise(mmap.MADV_DONTNEED)  # the looked-at page, which this mapping would keep cached
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if in_small_pages(array):
                with contextlib.suppress(OSError):
                    marker.write_text(f"{BOOT_ID.read_text().strip()} {UNHELPED}")
    return array


def in_small_pages(array: np.ndarray) -> bool:
    """Whether a 2 MiB-aligned page inside the mapping, read once, is mapped by 4 KiB entries: the folio the
    cache holds there is smaller than 2 MiB. False where that cannot be told (a file under 4 MiB, no smaps,
    a kernel that reports no FilePmdMapped)."""
    start = array.ctypes.data
    probe = (start + HUGE) // HUGE * HUGE
    if probe + HUGE > start + array.size:
        return False
    int(array[probe - start])  # read in (and map) that page
    try:
        lines = SMAPS.read_text().splitlines()
    except OSError:
        return False
    within = False
    for line in lines:
        field = line.split(maxsplit=1)[0] if line else ""
        if "-" in field and not field.endswith(":"):
            low, high = (int(bound, 16) for bound in field.split("-"))
            within = low <= probe < high
        elif within and field == "FilePmdMapped:":
            return int(line.split()[1]) == 0
    return False


def may_drop(marker: Path) -> bool:
    """Whether huge pages are on (`always` or `madvise`) and dropping this file's pages has not failed to
    help since the machine booted. False wherever the boot's id or the setting cannot be read."""
    try:
        boot = BOOT_ID.read_text().strip()
        if "[never]" in THP_ENABLED.read_text():
            return False
        return not (marker.is_file() and marker.read_text() == f"{boot} {UNHELPED}")
    except OSError:
        return False
