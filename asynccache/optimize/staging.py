"""Staging directories of ``optimize`` workers: each held by its owner, swept once orphaned.

A worker stages closed chunks in ``asynccache-staging-<pid>-*`` under the staging
directory (default: the temp directory) and removes it when done. A worker killed with
``kill -9`` cannot, so each staging directory holds an ``.owner`` file its process keeps
flock-ed. The next worker to make a staging directory in the same place (and a driver
that killed its workers) removes those whose lock nobody holds: their owner is gone,
whoever it was. One without an owner file is removed only when the pid in its name is
gone (its worker was killed between making it and locking it); one whose name carries no
pid (not made by this code) is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ..bridge import forksafe
from ..bridge.lifeline import pid_alive
from ..cache.locks import try_lock

__all__ = ["PREFIX", "StagingDir", "sweep_orphans"]

PREFIX = "asynccache-staging-"
_OWNER = ".owner"


class StagingDir:
    """A fresh staging directory under ``parent``, locked by this process until closed."""

    def __init__(self, parent: str | None = None) -> None:
        parent = parent or tempfile.gettempdir()
        sweep_orphans(parent)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)
        self._pid = os.getpid()  # a forked child's copy removes nothing
        self._fd: int | None = forksafe.open_fd(
            os.path.join(self.path, _OWNER), os.O_RDWR | os.O_CREAT, 0o600
        )
        try_lock(self._fd, exclusive=True)  # a new file: nobody else can hold it

    def close(self) -> None:
        """Remove the directory and everything in it. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            shutil.rmtree(self.path, ignore_errors=True)
            forksafe.close_fd(fd)


def sweep_orphans(parent: str) -> list[str]:
    """Remove the staging directories under ``parent`` whose owner is gone; their paths."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(path, _OWNER), os.O_RDWR)
        except FileNotFoundError:  # killed before it locked, or being made this instant
            pid = name[len(PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        except OSError:
            continue
        try:
            if try_lock(fd, exclusive=True):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:  # cannot lock here (e.g. no flock on this file system): leave it
            pass
        finally:
            os.close(fd)
    return removed
