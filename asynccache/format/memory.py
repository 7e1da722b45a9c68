"""Large byte buffers in base pages.

numpy advises transparent huge pages for every array of 4 MiB or more. Where the kernel
hands out huge pages the host has not yet backed (a virtual machine that gives freed
memory back to its host), the first touch of each is slow: filling a fresh 256 MiB
``np.empty`` cost 2.1-3.6 s against 0.12-0.13 s for the same bytes in base pages
(docs/performance.md, "Huge pages on first touch"). A batch buffer or a range read is
filled once, straight after it is made, so it gains little from huge pages and can lose
seconds; it comes from :func:`fresh_bytes`.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["HUGE_FROM", "fresh_bytes"]

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
