"""Large buffers filled once come in base pages (asynccache/format/memory.py).

numpy advises huge pages for arrays of 4 MiB or more; the first touch of fresh huge pages
cost seconds per 256 MiB on a virtual machine that returns freed memory to its host. The
buffers a batch or a range read is filled into are advised against them: checked in the
kernel's own record of each mapping (``VmFlags`` in ``/proc/self/smaps``: ``nh``, no huge
pages; ``hg``, huge pages advised).
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from asynccache.download.ranges import ALIGN, aligned_buffer
from asynccache.format import memory
from asynccache.format.memory import HUGE_FROM, fresh_bytes, populate

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_NOHUGEPAGE"),
    reason="VmFlags and MADV_NOHUGEPAGE are Linux's",
)

MIB = 1 << 20


def mapping_field(a: np.ndarray, field: str) -> int:
    """``field`` (kB) of the mapping that holds ``a``'s first byte, in ``/proc/self/smaps``."""
    addr = a.ctypes.data
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def vm_flags(a: np.ndarray) -> set[str]:
    """The ``VmFlags`` of the mapping that holds ``a``'s first byte."""
    addr = a.ctypes.data
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_fresh_bytes_are_zero_writable_page_aligned_and_not_huge():
    a = fresh_bytes(8 * MIB)
    assert a.size == 8 * MIB and a.dtype == np.uint8 and a.flags.writeable
    assert a.ctypes.data % mmap.PAGESIZE == 0
    assert not a.any()
    a[:] = 7  # every page touched
    assert int(a[-1]) == 7
    flags = vm_flags(a)
    assert "nh" in flags and "hg" not in flags


def test_small_buffers_are_plain_zeroed_arrays():
    """Below numpy's huge page threshold no mapping of its own (a syscall each)."""
    assert fresh_bytes(0).size == 0
    small = fresh_bytes(HUGE_FROM - 1)
    assert small.size == HUGE_FROM - 1 and small.flags.writeable and not small.any()
    assert aligned_buffer(100).ctypes.data % ALIGN == 0


def test_numpy_alone_would_advise_huge_pages():
    """What the other tests rule out: a plain array of this size, where numpy advises
    huge pages (it does on Linux unless NUMPY_MADVISE_HUGEPAGE=0)."""
    if not np._core.multiarray._get_madvise_hugepage():  # type: ignore[attr-defined]
        pytest.skip("numpy's huge page advice is off here")
    a = np.empty(8 * MIB, np.uint8)
    a[:] = 1
    assert "nh" not in vm_flags(a)


def test_a_range_read_buffer_is_aligned_and_not_huge():
    a = aligned_buffer(16 * MIB + 3)
    assert a.size == 16 * MIB + 3 and a.ctypes.data % ALIGN == 0 and a.flags.writeable
    assert "nh" in vm_flags(a)


def test_the_consumers_own_pooled_batch_buffer_is_not_huge():
    """The main process's pooled buffer (``here``: it consumes the batches itself), which
    the first batches of every epoch are built into."""
    from asynccache.torch import batches

    block = batches.shared_bytes(batches.BLOCK_BYTES)
    pool = batches.Pool(block, "t-memory", batches.MAIN_ROW, here=True)
    slot, buf = pool.take(32 * MIB)
    assert slot >= 0 and buf.numel() >= 32 * MIB
    assert "nh" in vm_flags(buf.numpy())


def test_populate_maps_a_buffer_inherited_by_a_fork_before_it_is_written():
    """A shared buffer written by the parent is in a forked child's address space but not
    in its page tables (Rss 0 there); after ``populate`` every page is, with the parent's
    bytes, and the child's writes reach the parent."""
    m = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_SHARED)
    buf = np.frombuffer(m, np.uint8)
    buf[:] = 3
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once (no pytest teardown here)
        try:
            before = mapping_field(buf, "Rss")
            done = populate(buf[10 : 3 * MIB])
            after = mapping_field(buf, "Rss")
            intact = bool((buf == 3).all())
            buf[: 3 * MIB] = 9
            os.write(w, f"{before} {int(done)} {after} {int(intact)}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        before, done, after, intact = (int(x) for x in f.read().split())
    os.waitpid(pid, 0)
    assert done == 1, "MADV_POPULATE_WRITE refused (Linux 5.14 or later is assumed here)"
    assert before < 1024, "the child had the pages mapped before populate"
    assert after >= 3 * 1024, "populate mapped every page of the range in the child"
    assert intact and int(buf[0]) == 9 and int(buf[3 * MIB]) == 3


def test_populate_declines_where_the_kernel_refuses(monkeypatch):
    """An advice the kernel refuses (an unknown one here) is never asked again; the
    buffer is written as before."""
    monkeypatch.setattr(memory, "_POPULATE_WRITE", 0x7FFF)
    monkeypatch.setattr(memory, "_unsupported", [])
    a = fresh_bytes(8 * MIB)
    assert populate(a) is False and memory._unsupported == [True]
    assert populate(a) is False
    assert populate(a[:0]) is False
