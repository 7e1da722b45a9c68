"""Cross-process file locks (``fcntl.flock``), released by the kernel when a process dies.

No refcount files and no shared memory: a crashed process leaves nothing to clean up but
temporary files, which are recognised as orphans because nobody holds their lock.

A flock belongs to the open file description, so every descriptor here is tracked by
:mod:`asynccache.bridge.forksafe` from the moment it is opened: a forked child closes its copy
at once and never keeps the parent's lock alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..bridge import forksafe
from ..errors import CacheError

__all__ = ["FileLock", "in_thread", "open_lock_file", "try_lock", "wait_lock"]

T = TypeVar("T")

log = logging.getLogger(__name__)

_THREAD_FINISH_S = 60.0
# A wait for another holder's lock this long is said in the log, with the holder's pid.
_WARN_AFTER_S = 30.0


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
        forksafe.close_fd(fd)
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
                forksafe.close_fd(fd)
                return
            state[0] = "granted" if error is None else "failed"
        with contextlib.suppress(RuntimeError):  # loop closed: the waiter is gone too
            loop.call_soon_threadsafe(deliver, error)

    thread = threading.Thread(target=block, name="asynccache-flock", daemon=True)
    thread.start()
    holders = ""
    try:
        start = loop.time()
        if timeout > _WARN_AFTER_S:
            try:
                await asyncio.wait_for(asyncio.shield(fut), _WARN_AFTER_S)
            except asyncio.TimeoutError:
                holders = _holders(fd)
                log.warning(
                    "waiting %gs so far for the lock on %s, %s; giving up after %gs",
                    _WARN_AFTER_S,
                    what,
                    holders,
                    timeout,
                )
        if not fut.done():
            await asyncio.wait_for(asyncio.shield(fut), max(timeout - (loop.time() - start), 0))
    except BaseException as exc:
        if isinstance(exc, asyncio.TimeoutError) and not holders:
            holders = _holders(fd)  # (fd is open until the state changes below)
        with mu:
            if state[0] == "waiting":
                state[0] = "abandoned"  # the thread closes fd once it wakes
            else:
                forksafe.close_fd(fd)
        if isinstance(exc, asyncio.TimeoutError):
            raise CacheError(f"waited {timeout}s for the lock on {what}, {holders}") from exc
        raise


def _holders(fd: int) -> str:
    """Who holds a flock on ``fd``'s file, as far as ``/proc/locks`` says (Linux): the
    pids that took the locks (a process that inherited such a descriptor holds it too)."""
    try:
        st = os.fstat(fd)
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        pids = []
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters: "->")
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
                    pids.append(parts[4])
    except (OSError, ValueError):
        return "held by another process"
    if not pids:
        return "held by another process"
    return (
        "held by pid "
        + ", ".join(dict.fromkeys(pids))
        + " (or a process that inherited its descriptor)"
    )


def open_lock_file(path: str, ensure_dir: Callable[[], None] | None = None) -> int:
    """Open (creating) a lock file; the descriptor is tracked for fork safety.

    Args:
        path: the lock file.
        ensure_dir: called once if the directory is missing (deleted underneath a running
            job), to rebuild it before opening again.

    Raises:
        CacheError: the file cannot be opened (names it).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        try:
            fd = forksafe.open_fd(path, flags)
        except FileNotFoundError:
            if ensure_dir is None:
                raise
            ensure_dir()
            fd = forksafe.open_fd(path, flags)
    except OSError as exc:
        raise CacheError(f"cannot open the lock file {path}: {exc.strerror or exc}") from exc
    return fd


class FileLock:
    """An exclusive or shared flock on a lock file, for ``async with``.

    Invariants:
        * The descriptor is open exactly while the lock is held; a failed or cancelled
          acquire leaves nothing open (see :func:`wait_lock`).
        * It is tracked by :mod:`asynccache.bridge.forksafe`, also while a helper thread waits
          on it: a forked child closes its copy and this object forgets it there.

    Args:
        path: the lock file (created if missing).
        exclusive: exclusive or shared.
        timeout: the bound on waiting for another holder.
        ensure_dir: rebuilds the lock file's directory when it was deleted underneath.
    """

    def __init__(
        self,
        path: str,
        *,
        exclusive: bool = True,
        timeout: float,
        ensure_dir: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.exclusive = exclusive
        self.timeout = timeout
        self._ensure_dir = ensure_dir
        self._fd: int | None = None
        forksafe.register(self)

    async def acquire(self) -> None:
        fd = open_lock_file(self.path, self._ensure_dir)
        await wait_lock(fd, self.exclusive, self.timeout, self.path)  # closes fd on failure
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            forksafe.close_fd(fd)  # closing the last descriptor drops the flock

    def _after_fork_in_child(self) -> None:
        # forksafe already closed the descriptor; the lock stays the parent's.
        self._fd = None

    async def __aenter__(self) -> FileLock:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
