"""The one owner of fork hygiene: what a forked child must not inherit.

A ``flock`` belongs to the open file description, so a child that inherits a descriptor
keeps the parent's lock alive after the parent closes its own copy. A ``threading.Lock``
held by another thread at the moment of ``fork`` stays locked forever in the child, whose
copy of that thread does not exist. And tables that describe what "this process" holds
(pins, open chunks, sessions) describe the parent, not the child.

So everything in the library that opens a descriptor which may carry a lock, or holds a
mutex or a per-process table, registers here:

* :func:`track_fd` / :func:`close_fd`: a descriptor the child must close at once;
* :func:`register`: an object whose ``_after_fork_in_child()`` resets its state (new
  mutexes, empty tables, descriptors forgotten, not closed twice).

In the child, every tracked descriptor is closed first, then every registered object is
reset, before any code of the child runs. The parent is untouched. ``spawn`` and
``forkserver`` children start from a fresh interpreter and need none of this, but the
same tests run under all three start methods.

Layer: stdlib only; every other module may import it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Protocol

__all__ = [
    "ForkResettable",
    "close_fd",
    "dup_fd",
    "open_fd",
    "register",
    "track_fd",
    "tracked_fds",
    "untrack_fd",
]


class ForkResettable(Protocol):
    def _after_fork_in_child(self) -> None: ...


class _Registry:
    """Descriptors and objects to reset in a forked child. Invariant: ``mu`` is held only
    for set operations (never across I/O: an ``open`` that waits for the file system
    blocks no other thread), and across ``fork`` itself, so the child never sees a
    half-updated set. ``forks`` counts the forks, so an open that a fork overlapped is
    known (see :func:`open_fd`)."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.fds: set[int] = set()
        self.objects: weakref.WeakSet[ForkResettable] = weakref.WeakSet()
        self.forks = 0
        # Opens in flight without the mutex (see open_fd): their paths, so a child forked
        # in the middle of one closes the copy it got.
        self.opening: dict[int, str | os.PathLike[str]] = {}
        # Closes in flight without the mutex (see close_fd): each descriptor with the
        # file it is open on, so a child forked in the middle of one closes its copy
        # (and only that file: the number may have been reused by then).
        self.closing: dict[int, tuple[int, tuple[int, int]]] = {}
        self._next = 0

    def begin_open(self, path: str | os.PathLike[str]) -> int:
        """Record an open about to run without the mutex; the caller holds ``mu``."""
        self._next += 1
        self.opening[self._next] = path
        return self._next

    def begin_close(self, fd: int, key: tuple[int, int] | None) -> int:
        """Untrack ``fd``, about to be closed without the mutex; the caller holds ``mu``."""
        self.fds.discard(fd)
        self._next += 1
        if key is not None:
            self.closing[self._next] = (fd, key)
        return self._next

    def before_fork(self) -> None:
        self.mu.acquire()
        self.forks += 1

    def after_fork_in_parent(self) -> None:
        self.mu.release()

    def after_fork_in_child(self) -> None:
        self.mu = threading.Lock()
        fds, self.fds = self.fds, set()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        closing, self.closing = self.closing, {}
        for fd, key in closing.values():
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == key:  # still the copy: the parent's close was late
                    os.close(fd)
        opening, self.opening = self.opening, {}
        if opening:
            _close_copies_of(opening.values())
        for obj in list(self.objects):
            obj._after_fork_in_child()


_registry = _Registry()


def track_fd(fd: int) -> int:
    """Close ``fd`` in any child forked while it is tracked; returns ``fd``."""
    with _registry.mu:
        _registry.fds.add(fd)
    return fd


def open_fd(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open`` and :func:`track_fd`, so that no child keeps the descriptor.

    The open runs without the registry mutex (creating a file may wait for a journal
    commit; other threads opening or closing tracked descriptors meanwhile do not wait
    for it), and the descriptor is tracked right after. A fork between the two leaves the
    child a copy it does not know of; so when a fork overlapped the open, the descriptor
    is replaced, before anything locks it, by a fresh open of the same file through
    ``/proc/self/fd`` (a new open file description, shared with no child: a flock taken
    on it later is this process's alone). The child closes its copy as it starts: the
    paths of opens in flight at the fork are recorded, and the child closes whatever it
    holds open on those files after its tracked descriptors (:func:`_close_copies_of`). Where
    ``/proc/self/fd`` is missing the mutex is held across the open, as a fork waits for
    it. Raises what ``os.open`` raises.
    """
    if not _can_reopen():
        with _registry.mu:
            fd = os.open(path, flags | os.O_CLOEXEC, mode)
            _registry.fds.add(fd)
        return fd
    with _registry.mu:
        forks = _registry.forks
        token = _registry.begin_open(path)
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, mode)
        while True:
            with _registry.mu:
                if _registry.forks == forks:
                    _registry.fds.add(fd)
                    return fd
                forks = _registry.forks
            # A fork overlapped: the same file, a description of our own (no create, no
            # truncate: it exists and is what we opened).
            again = _REOPEN_FLAGS & flags
            try:
                new = os.open(f"{_PROC_FD}{fd}", again | os.O_CLOEXEC)
            finally:
                os.close(fd)
            fd = new
    finally:
        with _registry.mu:
            _registry.opening.pop(token, None)


def _close_copies_of(paths: Iterable[str | os.PathLike[str]]) -> None:
    """In a forked child: close every descriptor of the files that opens in flight at
    the fork were opening (the child's copies, which no table of the child knows).
    Only files of the library are opened through :func:`open_fd`, and the tracked
    descriptors are already closed, so what is left open on those files is a copy."""
    keys = set()
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            keys.add((st.st_dev, st.st_ino))
    if not keys:
        return
    with contextlib.suppress(OSError):
        for name in os.listdir(_PROC_FD):
            with contextlib.suppress(OSError, ValueError):
                fd = int(name)
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) in keys:
                    os.close(fd)


_PROC_FD = "/proc/self/fd/"
# Flags kept when reopening through /proc/self/fd: the access mode and the file status
# flags, never O_CREAT, O_EXCL or O_TRUNC.
_REOPEN_FLAGS = ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
_reopen: list[bool] = []


def _can_reopen() -> bool:
    if not _reopen:
        _reopen.append(sys.platform.startswith("linux") and os.path.isdir(_PROC_FD))
    return _reopen[0]


def dup_fd(fd: int) -> int:
    """``os.dup`` of ``fd`` (close-on-exec), tracked in the same step like :func:`open_fd`.

    The duplicate shares ``fd``'s open file description, and so its flock.
    """
    with _registry.mu:
        new = os.dup(fd)
        _registry.fds.add(new)
    return new


def untrack_fd(fd: int) -> None:
    """Stop tracking ``fd`` (call it before closing the descriptor)."""
    with _registry.mu:
        _registry.fds.discard(fd)


def close_fd(fd: int) -> None:
    """Untrack and close ``fd``.

    The close runs without the registry mutex (closing the last descriptor of a deleted
    file frees its blocks, which may wait for the file system), but never unguarded: a
    child forked between the untracking and the close inherits a copy of ``fd`` that no
    table of the child lists, and a copy of a locked descriptor keeps the flock alive for
    the child's life (a DataLoader worker forked while the main process let a download
    lock go held that chunk's lock for the whole epoch, and the worker that needed the
    chunk waited for it). So the close is recorded with the file it is open on, and
    such a child closes its copy as it starts, if its descriptor of that number is still
    open on that file (by then the number may name another file, which it leaves alone).
    """
    try:
        st = os.fstat(fd)
        key: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        key = None  # not open: os.close raises below, as before
    with _registry.mu:
        token = _registry.begin_close(fd, key)
    try:
        os.close(fd)
    finally:
        with _registry.mu:
            _registry.closing.pop(token, None)


def tracked_fds() -> frozenset[int]:
    """The descriptors a child forked now would close (for tests and ``__repr__``)."""
    with _registry.mu:
        return frozenset(_registry.fds)


def register(obj: ForkResettable) -> None:
    """Call ``obj._after_fork_in_child()`` in every child forked while ``obj`` lives.

    Held weakly. Tracked descriptors are already closed when it runs: the object must
    forget them, not close them again (the numbers may be reused by then).
    """
    with _registry.mu:
        _registry.objects.add(obj)


os.register_at_fork(
    before=_registry.before_fork,
    after_in_parent=_registry.after_fork_in_parent,
    after_in_child=_registry.after_fork_in_child,
)
