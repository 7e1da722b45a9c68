"""Cross-process file locks (``fcntl.flock``), released by the kernel when a process dies.

No refcount files and no shared memory: a crashed process leaves nothing to clean up but
temporary files, which are recognised as orphans because nobody holds their lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CacheError

__all__ = ["FileLock", "in_thread", "try_lock", "wait_lock"]

T = TypeVar("T")

_THREAD_FINISH_S = 60.0


async def in_thread(
    fn: Callable[..., T], *args: Any, undo: Callable[[T], object] | None = None
) -> T:
    """``fn(*args)`` on a worker thread, never abandoned half-way by a cancellation.

    If the caller is cancelled, this still waits (bounded) for ``fn`` to return before
    re-raising, so cleanup code never races with it on the same file descriptor; a result
    nobody will receive is passed to ``undo``.
    """
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut], timeout=_THREAD_FINISH_S)
        if undo is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            undo(fut.result())
        raise


def try_lock(fd: int, exclusive: bool) -> bool:
    """Take a flock on ``fd`` without blocking; False when another holder conflicts."""
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    try:
        fcntl.flock(fd, op)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


async def wait_lock(fd: int, exclusive: bool, timeout: float, what: str) -> None:
    """Take a flock on ``fd``, waiting at most ``timeout`` seconds. No polling.

    The blocking ``flock`` runs on a named daemon thread; the loop awaits its result with
    a bound. Ownership of ``fd``: on success the caller keeps it; on any failure
    (timeout, cancellation, error) ``fd`` is closed here or, if the thread is still
    blocked, by that thread as soon as the kernel grants the lock (the holder is a live
    process whose own work is bounded, or a dead one whose lock the kernel dropped).

    Raises:
        CacheError: not granted within ``timeout``; the message names ``what``.
    """
    try:
        granted = try_lock(fd, exclusive)
    except BaseException:
        os.close(fd)
        raise
    if granted:
        return
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    mu = threading.Lock()
    state = ["waiting"]  # -> "granted" | "failed" | "abandoned"
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH

    def deliver(exc: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(None)

    def block() -> None:
        error: BaseException | None = None
        try:
            fcntl.flock(fd, op)
        except OSError as exc:
            error = exc
        with mu:
            if state[0] == "abandoned":
                os.close(fd)
                return
            state[0] = "granted" if error is None else "failed"
        with contextlib.suppress(RuntimeError):  # loop closed: the waiter is gone too
            loop.call_soon_threadsafe(deliver, error)

    thread = threading.Thread(target=block, name="asynccache-flock", daemon=True)
    thread.start()
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout)
    except BaseException as exc:
        with mu:
            if state[0] == "waiting":
                state[0] = "abandoned"  # the thread closes fd once it wakes
            else:
                os.close(fd)
        if isinstance(exc, asyncio.TimeoutError):
            raise CacheError(f"waited {timeout}s for the lock on {what}") from exc
        raise


class FileLock:
    """An exclusive or shared flock on a lock file, for ``async with``.

    Invariant: the descriptor is open exactly while the lock is held; a failed or
    cancelled acquire leaves nothing open (see :func:`wait_lock`).
    """

    def __init__(self, path: str, *, exclusive: bool = True, timeout: float) -> None:
        self.path = path
        self.exclusive = exclusive
        self.timeout = timeout
        self._fd: int | None = None

    async def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        await wait_lock(fd, self.exclusive, self.timeout, self.path)  # closes fd on failure
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor drops the flock

    async def __aenter__(self) -> FileLock:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
