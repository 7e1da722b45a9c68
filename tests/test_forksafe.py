"""A fork between a tracked descriptor's untracking and its close.

``forksafe.close_fd`` closes without the registry mutex. A child forked in between
inherits a copy of the descriptor that no table of the child lists; a copy of a locked
descriptor keeps the flock alive for the child's life (a DataLoader worker forked while
the main process let a chunk's download lock go held that lock for the whole epoch, and
the worker that needed the chunk waited for it). These tests fork for real at that
instant and check that the child let go, and that the parent's lock is gone.
"""

from __future__ import annotations

import fcntl
import os
import time

import pytest

from asynccache.bridge import forksafe
from asynccache.cache.locks import try_lock

_BOUND_S = 20.0


def _wait_exit(pid: int) -> int:
    deadline = time.monotonic() + _BOUND_S
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child did not exit")
        time.sleep(0.01)


def _fork_inside_close(monkeypatch, target: int, child) -> list[int]:  # type: ignore[no-untyped-def]
    """Patch ``os.close`` so that closing ``target`` forks first (once); the child runs
    ``child()`` after the fork hooks and exits with its result."""
    real = os.close
    forked: list[int] = []

    def close_after_fork(fd: int) -> None:
        if fd == target and not forked:
            forked.append(0)  # seen by the child too: its own closes are real
            pid = os.fork()
            if pid == 0:
                code = 70
                try:
                    code = child()
                finally:
                    os._exit(code)
            forked[0] = pid
        real(fd)

    monkeypatch.setattr(os, "close", close_after_fork)
    return forked


def test_child_forked_during_close_drops_the_lock(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "chunk.lock")
    fd = forksafe.open_fd(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()

    def child() -> int:
        os.close(w)
        os.write(ready_w, b"!")  # the fork hooks have run by now
        os.read(r, 1)  # alive until the parent has checked the lock (EOF when it is done)
        return 0

    forked = _fork_inside_close(monkeypatch, fd, child)
    forksafe.close_fd(fd)  # the parent lets the lock go; a child was forked in between
    monkeypatch.undo()
    os.close(r)
    os.close(ready_w)
    try:
        assert forked and forked[0] > 0, "the fault did not fire: no fork inside the close"
        assert os.read(ready_r, 1) == b"!"  # (a child that died first gives EOF)
        probe = os.open(path, os.O_RDWR)
        try:
            # Without the fix the live child's copy still holds the exclusive lock.
            assert try_lock(probe, exclusive=True), "a child forked mid-close kept the lock"
        finally:
            os.close(probe)
    finally:
        os.close(w)
        os.close(ready_r)
        assert _wait_exit(forked[0]) == 0
    assert not forksafe._registry.closing  # nothing left recorded in the parent


def test_child_leaves_a_reused_number_alone(tmp_path, monkeypatch) -> None:
    """The parent's close completed and the number was reused for another file before the
    fork: the child keeps that descriptor (it is not the one being closed)."""
    a = str(tmp_path / "a.lock")
    b = str(tmp_path / "b.other")
    fd = forksafe.open_fd(a, os.O_RDWR | os.O_CREAT)
    real = os.close
    results: list[int] = []

    def close_reuse_then_fork(n: int) -> None:
        real(n)
        if n == fd and not results:
            results.append(0)
            other = os.open(b, os.O_RDWR | os.O_CREAT, 0o644)  # untracked, likely the same number
            pid = os.fork()
            if pid == 0:
                try:
                    os.fstat(other)
                except OSError:
                    os._exit(3)  # the child closed a descriptor that was not ours
                os._exit(0)
            results[:] = [pid, other]

    monkeypatch.setattr(os, "close", close_reuse_then_fork)
    forksafe.close_fd(fd)
    monkeypatch.undo()
    pid, other = results
    try:
        assert other == fd, "the number was not reused: the case did not arise"
        assert _wait_exit(pid) == 0, "the child closed another file's descriptor"
    finally:
        os.close(other)
