"""Start the kernel's writeback of a byte range early, so the fsync at publish is short.

A chunk fsynced before its name appears (a durable store where no boot stamp can be
written, or ``ASYNCCACHE_FSYNC_PUBLISH=1``: see :mod:`asynccache.cache.stamp`) is asked
for this; a stamped chunk is left to the kernel.
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

A request costs the I/O thread little: no future and no executor work item, just an
entry on a queue the thread drains, and a wake-up only when the thread sleeps. It sleeps
only after 0.1 s without a request (until then it looks at the queue every 10 ms), so
while downloads run, requests wait on the queue without one, as they do while the thread
blocks in a call. What it finds queued it coalesces: adjacent ranges of one file become
one call.

Descriptor lifetime: each queued request holds a duplicate of the file's descriptor, made
on the requesting thread while the file is open (:func:`asynccache.bridge.forksafe.dup_fd`), and
closed by the writeback thread once the request is done or dropped. A call therefore
always names the file it was asked for, even when the file was published, discarded and
its descriptor number reused meanwhile; a file closed before its turn is skipped (its
writeback would be work for nothing). A forked child closes the duplicates it inherited
(they are tracked) and starts a queue and thread of its own; the parent's are never
touched there. The queue is bounded (:data:`MAX_QUEUED`): past it a request is dropped,
which changes nothing but timing.

Linux only; elsewhere (or when libc lacks the call) :func:`start_writeback` does nothing.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ..bridge import forksafe

__all__ = ["MAX_QUEUED", "WRITEBACK_BYTES", "flush", "request_writeback", "start_writeback"]

log = logging.getLogger(__name__)

#: How many written bytes of one stream to gather before asking for their writeback.
WRITEBACK_BYTES = 8 << 20

#: Requests waiting for the writeback thread at most; past it a request is dropped.
MAX_QUEUED = 256

_SYNC_FILE_RANGE_WRITE = 2
_IDLE_WAIT_S = 60.0  # the sleeping thread looks at its queue at least this often
# After its last request the thread stays awake this long, looking at its queue every
# _LINGER_S, before it sleeps: a download asks every 8 MiB (every 10-30 ms on loopback),
# and a request that finds the thread awake costs the I/O thread no wake-up.
_LINGER_S = 0.01
_LINGER_POLLS = 10


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


_Request = tuple[_Open, int, int, int]  # (file, our duplicate of its descriptor, offset, nbytes)


class _Writer:
    """One process's writeback thread and the queue it drains (see the module docstring).

    Invariants: only the thread pops the queue; ``sleeping`` is True only while the thread
    waits (or is about to wait) on ``wake`` and has seen the queue empty after setting it,
    so a request appended then always finds it True and sets ``wake``; ``queued`` counts
    the requests ever queued (by the requesting thread), ``done`` those finished (by the
    writeback thread, under ``idle``), for :func:`flush`.
    """

    def __init__(self) -> None:
        self.queue: collections.deque[_Request] = collections.deque()
        self.wake = threading.Event()
        self.idle = threading.Condition(threading.Lock())
        self.sleeping = False
        self.queued = 0
        self.done = 0
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="asynccache-writeback", daemon=True)
        self.thread.start()

    def put(self, request: _Request) -> None:
        self.queued += 1  # the I/O thread(s): a lost count only ends a flush() early
        self.queue.append(request)
        if self.sleeping:
            self.sleeping = False
            self.wake.set()

    def _run(self) -> None:
        queue = self.queue
        polls = 0
        while True:
            if not queue and polls < _LINGER_POLLS:
                # Still awake for the next request of a download in progress: it is
                # queued with no wake-up of this thread (see the module docstring).
                polls += 1
                time.sleep(_LINGER_S)
                continue
            if not queue:
                polls = 0
                self.wake.clear()
                self.sleeping = True
                if not queue:
                    self.wake.wait(_IDLE_WAIT_S)
                self.sleeping = False
                continue
            polls = 0
            batch: list[_Request] = []
            while queue:
                batch.append(queue.popleft())
            try:
                _write_back(batch)
            except Exception as exc:  # best effort: the fsync at publish still waits
                log.debug("writeback of %d ranges failed: %r", len(batch), exc)
            finally:
                with self.idle:
                    self.done += len(batch)
                    self.idle.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every request queued before this call is done (at most ``timeout``
        seconds); True when they are."""
        upto = self.queued
        with self.idle:
            return self.idle.wait_for(lambda: self.done >= upto, timeout)


def _write_back(batch: list[_Request]) -> None:
    """Start the writeback of ``batch``: adjacent ranges of one file in one call, files
    closed meanwhile skipped; every duplicate descriptor closed, whatever happens."""
    try:
        batch.sort(key=lambda r: (id(r[0]), r[2]))
        i = 0
        while i < len(batch):
            out, fd, offset, nbytes = batch[i]
            j = i + 1
            while j < len(batch) and batch[j][0] is out and batch[j][2] <= offset + nbytes:
                nbytes = max(nbytes, batch[j][2] + batch[j][3] - offset)
                j += 1
            if out.fd is not None:  # closed (published, discarded): nothing to ask
                start_writeback(fd, offset, nbytes)
            i = j
    finally:
        for request in batch:
            forksafe.close_fd(request[1])


_mu = threading.Lock()
_writer: _Writer | None = None


def _get() -> _Writer:
    """This process's writeback thread (a forked child starts its own: the parent's
    thread does not exist there, and its queue is left alone)."""
    global _writer
    held = _writer
    if held is not None and held.pid == os.getpid():
        return held
    with _mu:
        if _writer is None or _writer.pid != os.getpid():
            _writer = _Writer()
        return _writer


def _after_fork_in_child() -> None:
    global _mu, _writer
    _mu, _writer = threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork_in_child)


def request_writeback(out: _Open, offset: int, nbytes: int) -> bool:
    """:func:`start_writeback` of ``out``'s range, from this process's writeback thread,
    without waiting for it (see the module's docstring). Call it while ``out`` is open.

    True when the request was queued; False when there is nothing to ask (no range, no
    ``sync_file_range``, ``out`` closed) or the queue is full (dropped: best effort).
    """
    fd = out.fd
    if _sync_file_range is None or nbytes <= 0 or fd is None:
        return False
    writer = _get()
    if len(writer.queue) >= MAX_QUEUED:
        return False
    writer.put((out, forksafe.dup_fd(fd), offset, nbytes))
    return True


def flush(timeout: float = 10.0) -> bool:
    """Wait (at most ``timeout`` seconds) until this process's writeback requests so far
    are done; True when none is left. For tests and benchmarks: nothing needs to wait."""
    held = _writer
    if held is None or held.pid != os.getpid():
        return True
    return held.flush(timeout)
