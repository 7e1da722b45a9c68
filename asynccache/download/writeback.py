"""Start the kernel's writeback of a byte range early, so the fsync at publish is short.

A durable chunk is fsynced before its name appears (see :mod:`asynccache.cache.layout`).
Left alone, the kernel starts writing a file's dirty pages back only under memory pressure
or after ~30 s, so that fsync finds the whole chunk dirty and waits for all of it: the disk
and the network then take turns instead of overlapping. Asking for writeback of each range
as soon as it is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start, don't wait)
lets the disk work while the rest of the chunk downloads. It changes no guarantee: the
fsync at publish still waits for every page; this only makes it find less work.

Linux only; elsewhere (or when libc lacks the call) :func:`start_writeback` does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["WRITEBACK_BYTES", "start_writeback"]

#: How many written bytes of one stream to gather before asking for their writeback.
WRITEBACK_BYTES = 8 << 20

_SYNC_FILE_RANGE_WRITE = 2


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk.

    Does not wait for the disk. Best effort: a failure (an unsupported file system) is
    ignored, since the fsync at publish is what guarantees durability.
    """
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
