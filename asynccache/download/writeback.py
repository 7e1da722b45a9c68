"""Start the kernel's writeback of a byte range early, so the fsync at publish is short.

A durable chunk is fsynced before its name appears (see :mod:`asynccache.cache.layout`).
Left alone, the kernel starts writing a file's dirty pages back only under memory pressure
or after ~30 s, so that fsync finds the whole chunk dirty and waits for all of it: the disk
and the network then take turns instead of overlapping. Asking for writeback of each range
as soon as it is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start, don't wait)
lets the disk work while the rest of the chunk downloads. It changes no guarantee: the
fsync at publish still waits for every page; this only makes it find less work.

The request is made from a thread of its own (:func:`request_writeback`), never from the
I/O thread: ``sync_file_range`` blocks while the device's queue is full (a journal commit,
other files' fsyncs), and an I/O thread blocked there receives nothing on any connection.
One thread, so requests that block queue behind each other there and never take the
executor threads that verify and publish chunks.

Linux only; elsewhere (or when libc lacks the call) :func:`start_writeback` does nothing.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Protocol

__all__ = ["WRITEBACK_BYTES", "request_writeback", "start_writeback"]

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


class _Open(Protocol):
    """A file being written: its descriptor, None once closed."""

    fd: int | None


_mu = threading.Lock()
_thread: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, thread)


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    """This process's writeback thread (a forked child starts its own: the parent's
    thread does not exist there)."""
    global _thread
    pid = os.getpid()
    held = _thread
    if held is not None and held[0] == pid:
        return held[1]
    with _mu:
        if _thread is None or _thread[0] != pid:
            _thread = (pid, concurrent.futures.ThreadPoolExecutor(1, "asynccache-writeback"))
        return _thread[1]


def _after_fork_in_child() -> None:
    global _mu, _thread
    _mu, _thread = threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork_in_child)


def request_writeback(
    out: _Open, offset: int, nbytes: int
) -> concurrent.futures.Future[None] | None:
    """:func:`start_writeback` of ``out``'s range, from this process's writeback thread,
    without waiting for it (see the module's docstring).

    The file may be closed (published, discarded) before the thread gets to it: then
    nothing is asked. A descriptor number reused meanwhile could only start the writeback
    of another file's pages, which changes nothing but timing. Returns the request's
    future (None when there is nothing to ask), which nobody needs to wait for.
    """
    if _sync_file_range is None or nbytes <= 0:
        return None
    return _writer().submit(_writeback_of, out, offset, nbytes)


def _writeback_of(out: _Open, offset: int, nbytes: int) -> None:
    fd = out.fd
    if fd is not None:
        start_writeback(fd, offset, nbytes)
