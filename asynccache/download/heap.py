"""Give the C heap's free pages back to the system after a chunk lands.

A chunk arrives as pieces of up to 256 KiB (``bytes`` objects made by the event loop's
socket reads), each freed once written to the chunk file. glibc raises its threshold for
serving such sizes with their own mappings after the first is freed, so later pieces come
from the I/O thread's heap arena, and the arena keeps the pages of freed pieces resident
(megabytes of a DataLoader worker's memory, holding stale chunk bytes).
``malloc_trim(0)`` hands every whole free page of every arena back (``MADV_DONTNEED``).
It walks every arena's free chunks under their locks, milliseconds in a process that
imported torch, so it is called once an epoch's range reads are done (by the reader), not
after every chunk (where it would add a large share to a cold epoch's CPU).

The S3 and HTTP backends' own receive path (``ASYNCCACHE_RECEIVE=direct``, the default;
:mod:`asynccache.storage.wire`) reads chunk parts into one reused buffer and allocates no
pieces, as are the first batch's range reads (:mod:`.ranges`), so this matters there only
for what still comes through aiohttp (index files, other backends,
``ASYNCCACHE_RECEIVE=aiohttp``).

Linux with glibc only; elsewhere :func:`trim` does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["trim"]


def _load() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load()


def trim() -> None:
    """Return the free pages of the C heap to the system (best effort)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
