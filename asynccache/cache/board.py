"""Where each reader of a node stands in its epoch: one small shared file per read plan.

``<dataset dir>/.locks/plan-<key>.board`` has one fixed-width slot per reader of the node
(the key names the way of reading and the node's ranks: two nodes that share a directory
by mistake keep two boards, unless they read the same ranks, and so the same plan),
written only by that reader (``pwrite`` of its slot, no lock) each time it starts reading a chunk,
and read by any process that evicts. A slot holds ``epoch variant position``.

It is a hint, never a source of truth: a slot that is missing or torn, or names an
epoch other than the evicting process's or the next, reads as "at the start of this
epoch" (see :class:`.plan.PlanPolicy`), which only keeps more chunks (a reader that has
not started needs all of its part). Every reader rewrites its slot when it starts an
epoch, so a slot left by a reader that died lasts until the next epoch starts. A crash
therefore leaves nothing that matters; the file is a few hundred bytes and is reused by
the next run of the same plan.

Layer: stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import weakref

from ..bridge import forksafe
from .layout import LOCK_DIR

__all__ = ["Board", "board_path"]

_SLOT = 48
_TAG = b"p1"


def board_path(root: str | os.PathLike[str], key: str) -> str:
    return os.path.join(root, LOCK_DIR, f"plan-{key}.board")


class Board:
    """The slots of ``readers`` readers in the file at ``path`` (created on first write).

    Invariant: at most one descriptor is open, from the first write to :meth:`close`, or
    to the board's collection (a finalizer closes it), whichever comes first; a forked
    child never holds the parent's (:mod:`asynccache.bridge.forksafe` closes it there, and
    the child opens its own on its first write).
    """

    def __init__(self, path: str, readers: int) -> None:
        self.path = path
        self.readers = readers
        self._fd: int | None = None
        self._closer: weakref.finalize | None = None
        forksafe.register(self)

    def _open(self) -> int | None:
        if self._fd is None:
            try:
                fd = forksafe.open_fd(self.path, os.O_RDWR | os.O_CREAT)
            except OSError:
                return None  # a read-only or vanished cache: the plan degrades, never fails
            self._fd = fd
            self._closer = weakref.finalize(self, _close, fd, os.getpid())
            self._closer.atexit = False
        return self._fd

    def write(self, reader: int, epoch: int, variant: int, position: int) -> None:
        """Record where ``reader`` stands (never raises: the board is a hint)."""
        fd = self._open()
        if fd is None:
            return
        line = b"%s %d %d %d" % (_TAG, epoch, variant, position)
        with contextlib.suppress(OSError):
            os.pwrite(fd, line.ljust(_SLOT - 1) + b"\n", reader * _SLOT)

    def read(self) -> list[tuple[int, int, int] | None]:
        """Every reader's ``(epoch, variant, position)``, None where unknown."""
        out: list[tuple[int, int, int] | None] = [None] * self.readers
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return out
        try:
            raw = os.pread(fd, _SLOT * self.readers, 0)
        except OSError:
            return out
        finally:
            os.close(fd)
        for r in range(self.readers):
            fields = raw[r * _SLOT : (r + 1) * _SLOT].split()
            if len(fields) != 4 or fields[0] != _TAG:
                continue
            with contextlib.suppress(ValueError):
                out[r] = (int(fields[1]), int(fields[2]), int(fields[3]))
        return out

    def close(self) -> None:
        """Close the descriptor (the next write opens it again). Idempotent."""
        closer, self._closer, self._fd = self._closer, None, None
        if closer is not None:
            closer()

    def _after_fork_in_child(self) -> None:
        # forksafe closed the descriptor already: forget it, never close the number again.
        if self._closer is not None:
            self._closer.detach()
        self._closer, self._fd = None, None


def _close(fd: int, pid: int) -> None:
    if os.getpid() == pid:  # (a child forked meanwhile closed its copy at the fork)
        forksafe.close_fd(fd)
