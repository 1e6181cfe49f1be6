"""A GGUF's mapping (page_cache.map_file): the file's bytes, private, advised for huge pages, and its cached
pages dropped at most once a boot."""

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
    (and made)."""
    boot, thp = tmp_path / "boot_id", tmp_path / "enabled"
    boot.write_text("boot-a\n")
    thp.write_text("always [madvise] never\n")
    monkeypatch.setattr(page_cache, "BOOT_ID", boot)
    monkeypatch.setattr(page_cache, "THP_ENABLED", thp)
    calls = []
    real = os.posix_fadvise

    def recorded(fd, offset, length, advice):
        calls.append(advice)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    return boot, thp, calls


@pytest.fixture
def weights(tmp_path) -> tuple[Path, bytes]:
    data = np.random.default_rng().integers(0, 256, 3 * 2**20 + 12345, dtype=np.uint8).tobytes()
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
    array = page_cache.map_file(path, tmp_path / "marker")
    assert array.tobytes() == data
    array[:4096] ^= 0xFF  # torch may write to its tensors: the file keeps its bytes
    assert path.read_bytes() == data
    assert "hg" in vm_flags(array)  # MADV_HUGEPAGE


def test_the_cached_pages_are_dropped_on_the_first_load_of_a_boot_only(machine, weights, tmp_path):
    boot, _, calls = machine
    path, data = weights
    marker = tmp_path / "marker"
    for _ in range(3):
        assert page_cache.map_file(path, marker).tobytes() == data
    assert calls == [os.POSIX_FADV_DONTNEED]
    assert marker.read_text() == "boot-a"
    boot.write_text("boot-b\n")
    page_cache.map_file(path, marker)
    page_cache.map_file(path, marker)
    assert calls == [os.POSIX_FADV_DONTNEED] * 2


def test_nothing_is_dropped_without_huge_pages_a_boot_id_or_a_writable_marker(machine, weights, tmp_path):
    boot, thp, calls = machine
    path, data = weights
    thp.write_text("always madvise [never]\n")
    assert page_cache.map_file(path, tmp_path / "marker").tobytes() == data
    thp.write_text("[always] madvise never\n")
    assert page_cache.map_file(path, tmp_path / "no such folder" / "marker").tobytes() == data
    boot.unlink()
    assert page_cache.map_file(path, tmp_path / "marker").tobytes() == data
    assert calls == []
    assert not (tmp_path / "marker").exists()


def test_a_kernel_that_refuses_huge_pages_still_maps_the_file(machine, weights, tmp_path, monkeypatch):
    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(page_cache, "mmap", SimpleNamespace(
        mmap=Refusing, MAP_PRIVATE=mmap.MAP_PRIVATE, PROT_READ=mmap.PROT_READ, PROT_WRITE=mmap.PROT_WRITE,
        MADV_HUGEPAGE=getattr(mmap, "MADV_HUGEPAGE", 14)))
    path, data = weights
    assert page_cache.map_file(path, tmp_path / "marker").tobytes() == data
