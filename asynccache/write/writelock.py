"""The write lock of an output directory: one job writes into a directory at a time.

A write pass (one ``CacheDataLoader`` writing epoch, or one standalone ``Cache`` write)
holds an exclusive ``flock`` on ``<dir>/.write.lock`` from before it removes anything
until ``index.json`` is published. The lock file holds the pass's token, pid and host.

Invariants:

* The lock is held by one process of the job (rank 0's main process, or the process
  writing a standalone ``Cache``). The job's other writers (DataLoader workers, other
  ranks) don't take it: they check that the file names their token (:func:`check_token`),
  so a job's own workers are never locked out and a foreign job's workers are refused.
* The descriptor is tracked by :mod:`asynccache.bridge.forksafe`: a forked DataLoader worker
  closes its copy at once, so the lock never outlives the process that took it, and the
  kernel drops it when that process dies (no stale lock after a crash).
* The holder unlinks the file when it releases the lock (so a written dataset directory
  holds no trace of it). Another process may have opened the old file just before; so
  a process that gets the lock checks that the name still refers to the file it locked,
  and tries again otherwise: two processes never hold locks on two inodes of one name.

Layer: stdlib, errors, forksafe.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from typing import Any

from ..bridge import forksafe
from ..errors import CacheError, WriteConflictError

LOCK_NAME = ".write.lock"
_ATTEMPTS = 8


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def lock_path(directory: str) -> str:
    return os.path.join(directory, LOCK_NAME)


def read_holder(directory: str) -> dict[str, Any] | None:
    """What the lock file says about its last holder (``token``, ``pid``, ``host``)."""
    try:
        with open(lock_path(directory), "rb") as f:
            doc = json.loads(f.read() or b"null")
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def is_held(directory: str) -> bool:
    """True when some process holds the write lock of ``directory`` now.

    Answered by trying a shared, non-blocking lock (released at once). Only meaningful
    on one host: flock across hosts depends on the network file system.
    """
    try:  # tracked: a child forked meanwhile must not keep the probe's lock
        fd = forksafe.open_fd(lock_path(directory), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        forksafe.close_fd(fd)  # closing drops the probe's lock, if it got one
    return False


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another job"
    return f"another job (pid {holder.get('pid')} on {holder.get('host')})"


class WriteLock:
    """An acquired write lock; :meth:`release` (or process exit) gives it up."""

    def __init__(self, directory: str, token: str, fd: int) -> None:
        self.directory, self.token = directory, token
        self._fd: int | None = fd
        forksafe.register(self)

    @classmethod
    def acquire(cls, directory: str, token: str) -> WriteLock:
        """Take the lock of ``directory`` for the write pass ``token``, without waiting.

        Raises:
            WriteConflictError: another job holds it (names the directory and holder).
            CacheError: the directory can't be created or the lock file opened.
        """
        path = lock_path(directory)
        for _ in range(_ATTEMPTS):  # each retry means a holder just let go: bounded
            try:
                os.makedirs(directory, exist_ok=True)
                # Opened and tracked with no fork in between: no child inherits the lock.
                fd = forksafe.open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise CacheError(f"cannot lock {directory} for writing: {exc.strerror}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                forksafe.close_fd(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    why = exc.strerror
                    raise CacheError(f"cannot lock {directory} for writing: {why}") from exc
                raise WriteConflictError(
                    f"{directory}: {_describe(read_holder(directory))} is writing a dataset "
                    "here; wait for it to finish, or write to another directory"
                ) from None
            if _same_file(fd, path):
                break
            forksafe.close_fd(fd)  # locked a file its holder unlinked meanwhile
        else:
            raise WriteConflictError(f"{directory}: the write lock keeps changing hands")
        doc = {"token": token, "pid": os.getpid(), "host": socket.gethostname()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(doc).encode(), 0)
        return cls(directory, token, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the lock up. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                if _same_file(fd, lock_path(self.directory)):
                    os.unlink(lock_path(self.directory))  # still ours: unlink, then unlock
            with contextlib.suppress(OSError):
                forksafe.close_fd(fd)  # closing the description drops the flock

    def _after_fork_in_child(self) -> None:
        self._fd = None  # forksafe already closed the child's copy: forget it

    def __enter__(self) -> WriteLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"WriteLock({self.directory!r}, held={self.held})"


def check_token(directory: str, token: str) -> None:
    """Refuse to write for pass ``token`` when the directory's lock names another pass.

    Called by every writer of a job (workers, other ranks) before it writes anything.
    A missing lock file means no job coordinates here; nothing to check.

    Raises:
        WriteConflictError: another job took the directory over.
    """
    holder = read_holder(directory)
    if holder is not None and holder.get("token") != token:
        raise WriteConflictError(
            f"{directory}: {_describe(holder)} is writing a dataset here, not this job; "
            "this writer stops rather than mix its chunks with that job's"
        )
