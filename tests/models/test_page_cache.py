"""A GGUF's mapping (page_cache.map_file): the file's bytes, private, advised for huge pages; its cached pages
dropped where a look through the mapping finds them small, and not again in a boot where that did not help."""

import errno
import mmap
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pagedchat.engine.loading import page_cache

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """The boot's id and the huge-page setting as files this test writes; the posix_fadvise calls recorded
    (and made); `looks`: what in_small_pages answers, in turn (it is not asked more often)."""
    boot, thp = tmp_path / "boot_id", tmp_path / "enabled"
    boot.write_text("boot-a\n")
    thp.write_text("always [madvise] never\n")
    monkeypatch.setattr(page_cache, "BOOT_ID", boot)
    monkeypatch.setattr(page_cache, "THP_ENABLED", thp)
    calls, looks = [], []
    real = os.posix_fadvise

    def recorded(fd, offset, length, advice):
        calls.append(advice)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    monkeypatch.setattr(page_cache, "in_small_pages", lambda array: looks.pop(0))
    return SimpleNamespace(boot=boot, thp=thp, calls=calls, looks=looks)


@pytest.fixture
def weights(tmp_path) -> tuple[Path, bytes]:
    data = np.random.default_rng().integers(0, 256, 6 * 2**20 + 12345, dtype=np.uint8).tobytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    return path, data


def vm_flags(array: np.ndarray) -> list[str]:
    """The smaps VmFlags of the mapping that holds the array's first byte."""
    start, within = array.ctypes.data, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            low, high = (int(a, 16) for a in line.split()[0].split("-"))
            within = low <= start < high
        elif within and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError("no mapping holds the array")


def test_the_mapping_is_the_files_bytes_private_and_advised_for_huge_pages(machine, weights, tmp_path):
    path, data = weights
    machine.looks.append(False)
    array = page_cache.map_file(path, tmp_path / "marker")
    assert array.tobytes() == data
    array[:4096] ^= 0xFF  # torch may write to its tensors: the file keeps its bytes
    assert path.read_bytes() == data
    assert "hg" in vm_flags(array)  # MADV_HUGEPAGE
    assert machine.calls == [] and not machine.looks


def test_small_pages_are_dropped_and_not_again_in_a_boot_where_that_did_not_help(machine, weights, tmp_path):
    path, data = weights
    marker = tmp_path / "marker"
    machine.looks += [True, False]  # small, then large once dropped: nothing to remember
    assert page_cache.map_file(path, marker).tobytes() == data
    assert machine.calls == [os.POSIX_FADV_DONTNEED] and not marker.exists()
    machine.looks += [True, True]  # small again (another program read it back), and dropping did not help
    assert page_cache.map_file(path, marker).tobytes() == data
    assert machine.calls == [os.POSIX_FADV_DONTNEED] * 2
    assert marker.read_text() == "boot-a no larger pages"
    machine.looks += [True]
    assert page_cache.map_file(path, marker).tobytes() == data
    assert machine.calls == [os.POSIX_FADV_DONTNEED] * 2
    machine.boot.write_text("boot-b\n")  # a new boot tries again
    machine.looks += [True, False]
    page_cache.map_file(path, marker)
    assert machine.calls == [os.POSIX_FADV_DONTNEED] * 3 and not machine.looks


def test_nothing_is_dropped_where_pages_are_large_huge_pages_off_or_the_boot_unknown(machine, weights, tmp_path):
    path, data = weights
    machine.looks += [False, True, True]
    assert page_cache.map_file(path, tmp_path / "marker").tobytes() == data
    machine.thp.write_text("always madvise [never]\n")
    assert page_cache.map_file(path, tmp_path / "marker").tobytes() == data
    machine.thp.write_text("[always] madvise never\n")
    machine.boot.unlink()
    assert page_cache.map_file(path, tmp_path / "marker").tobytes() == data
    assert machine.calls == [] and not machine.looks


def test_a_kernel_that_refuses_huge_pages_still_maps_the_file(machine, weights, tmp_path, monkeypatch):
    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(page_cache, "mmap", SimpleNamespace(
        mmap=Refusing, MAP_PRIVATE=mmap.MAP_PRIVATE, PROT_READ=mmap.PROT_READ, PROT_WRITE=mmap.PROT_WRITE,
        MADV_HUGEPAGE=getattr(mmap, "MADV_HUGEPAGE", 14)))
    path, data = weights
    machine.looks.append(False)
    assert page_cache.map_file(path, tmp_path / "marker").tobytes() == data


@pytest.mark.parametrize("pmd_kb, small", [(0, True), (2048, False), (None, False)])
def test_the_look_reads_the_mappings_pmd_entries_in_smaps(weights, tmp_path, monkeypatch, pmd_kb, small):
    """in_small_pages against an smaps written here: the mapping that holds the 2 MiB page it reads, between
    two others that say the opposite."""
    path, _ = weights
    with open(path, "rb") as file:
        array = np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    start, end = array.ctypes.data, array.ctypes.data + array.size
    other = 2048 if pmd_kb == 0 else 0
    own = [] if pmd_kb is None else [f"FilePmdMapped:  {pmd_kb:>8} kB"]
    smaps = tmp_path / "smaps"
    smaps.write_text("\n".join([
        f"{start - 8192:x}-{start:x} r--p 00000000 fd:00 1 /lib/other.so", f"FilePmdMapped:  {other:>8} kB",
        f"{start:x}-{end:x} r--p 00000000 fd:00 2 {path}", "Size:  6156 kB", *own, "VmFlags: rd mr hg",
        f"{end:x}-{end + 8192:x} r--p 00000000 fd:00 3 /lib/next.so", f"FilePmdMapped:  {other:>8} kB", ""]))
    monkeypatch.setattr(page_cache, "SMAPS", smaps)
    assert page_cache.in_small_pages(array) is small
    assert page_cache.in_small_pages(array[: 2**21]) is False  # no whole aligned 2 MiB page inside
