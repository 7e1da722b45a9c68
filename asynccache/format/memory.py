"""Large byte buffers in base pages.

numpy advises transparent huge pages for every array of 4 MiB or more. Where the kernel
hands out huge pages the host has not yet backed (a virtual machine that gives freed
memory back to its host), the first touch of each is slow: filling a fresh 256 MiB
``np.empty`` cost 2.1-3.6 s against 0.12-0.13 s for the same bytes in base pages
(docs/performance.md, "Huge pages on first touch"). A batch buffer or a range read is
filled once, straight after it is made, so it gains little from huge pages and can lose
seconds; it comes from :func:`fresh_bytes`.

A shared buffer mapped before a fork is mapped in the child too, but the child has none
of its pages in its page tables: its first write to each page takes a fault. Writing
256 MiB into such a buffer took 0.09 s against 0.04 s in the parent; mapping every page
first in one call (:func:`populate`, ``MADV_POPULATE_WRITE``) and then writing, 0.055-0.062.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import numpy as np

__all__ = ["HUGE_FROM", "fresh_bytes", "populate"]

#: numpy advises huge pages from this size on (below it, its arrays are plain heap memory,
#: cheaper than a mapping of their own).
HUGE_FROM = 4 << 20


def fresh_bytes(nbytes: int) -> np.ndarray:
    """A writable, zero-filled uint8 array of ``nbytes``; from :data:`HUGE_FROM` on, on an
    anonymous mapping of its own (page-aligned, advised against huge pages where the
    kernel offers the advice, unmapped when the last view of it is gone)."""
    if nbytes < HUGE_FROM:
        return np.zeros(max(nbytes, 0), np.uint8)
    m = mmap.mmap(-1, nbytes)
    no_huge = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if no_huge is not None:  # (Linux; also where huge pages are on for every mapping)
        m.madvise(no_huge)
    return np.frombuffer(m, np.uint8)


#: ``MADV_POPULATE_WRITE`` (Linux 5.14 on; not in every Python's ``mmap``).
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_madvise: list[Any] = []  # libc's madvise, once looked up
_unsupported: list[bool] = []  # the kernel refused the advice once: never asked again


def populate(buf: np.ndarray) -> bool:
    """Map every page of ``buf`` (shared or anonymous memory, writable) for writing now,
    in one call, where the kernel offers ``MADV_POPULATE_WRITE``: for a buffer whose pages
    exist but are not yet in this process's page tables (mapped before a fork), which
    its next write fills whole. False where nothing was done (not Linux, an older kernel,
    an empty buffer); the buffer is then written with a fault per page, as before."""
    if not buf.nbytes or _unsupported or not sys.platform.startswith("linux"):
        return False
    if not _madvise:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise.append(fn)
    start = buf.ctypes.data & ~(mmap.PAGESIZE - 1)  # (the page holding the first byte)
    if _madvise[0](start, buf.ctypes.data + buf.nbytes - start, _POPULATE_WRITE) == 0:
        return True
    _unsupported.append(True)
    return False
