"""download.writeback: early writeback is asked from a thread of its own, never the caller's;
requests are queued without a future, coalesced, and always name the file asked for."""

from __future__ import annotations

import os
import threading

import pytest

from asynccache.bridge import forksafe
from asynccache.cache.layout import TempFile
from asynccache.download import writeback

pytestmark = pytest.mark.skipif(
    writeback._sync_file_range is None, reason="sync_file_range is Linux only"
)


@pytest.fixture
def calls(monkeypatch):
    """Every sync_file_range call: (thread name, fd's inode, offset, nbytes, flags)."""
    seen: list[tuple[str, int, int, int, int]] = []
    real = writeback._sync_file_range
    assert real is not None

    def record(fd: int, offset: int, nbytes: int, flags: int) -> int:
        ino = os.fstat(fd).st_ino
        seen.append((threading.current_thread().name, ino, offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "_sync_file_range", record)
    assert writeback.flush(10)
    return seen


def test_a_request_runs_on_the_writeback_thread_not_the_callers(tmp_path, calls):
    tmp = TempFile(tmp_path / "chunk-0-0.bin", 1 << 20)
    try:
        tmp.pwrite(b"x" * (1 << 20), 0)
        assert writeback.request_writeback(tmp, 0, 1 << 20)
        assert writeback.flush(10)
        assert len(calls) == 1
        name, ino, offset, nbytes, flags = calls[0]
        assert name.startswith("asynccache-writeback") and name != threading.current_thread().name
        assert (ino, offset, nbytes, flags) == (os.fstat(tmp.fd).st_ino, 0, 1 << 20, 2)
    finally:
        tmp.discard()
    assert not writeback.request_writeback(tmp, 0, 4096)  # closed: nothing to ask
    assert writeback.flush(10) and len(calls) == 1


def test_adjacent_ranges_queued_together_are_one_call(tmp_path, calls):
    a = TempFile(tmp_path / "chunk-0-0.bin", 3 << 20)
    b = TempFile(tmp_path / "chunk-0-1.bin", 1 << 20)
    hold = threading.Event()
    real = writeback._sync_file_range

    def blocked(fd: int, offset: int, nbytes: int, flags: int) -> int:
        hold.wait(10)  # the thread is busy (a full device queue): requests pile up
        return real(fd, offset, nbytes, flags)

    try:
        a.pwrite(b"x" * (3 << 20), 0)
        b.pwrite(b"y" * (1 << 20), 0)
        writeback._sync_file_range = blocked
        assert writeback.request_writeback(b, 0, 4096)  # the thread takes it and blocks
        while writeback._get().queue:
            threading.Event().wait(0.001)
        writeback._sync_file_range = real
        assert writeback.request_writeback(a, 1 << 20, 1 << 20)
        assert writeback.request_writeback(b, 1 << 20, 0) is False  # nothing to ask
        assert writeback.request_writeback(a, 0, 1 << 20)
        assert writeback.request_writeback(b, 4096, 4096)
        assert writeback.request_writeback(a, 2 << 20, 1 << 20)
        hold.set()
        assert writeback.flush(10)
        ia, ib = os.fstat(a.fd).st_ino, os.fstat(b.fd).st_ino
        # b's first range, then a's three ranges in one call and b's second.
        assert calls[0][1:4] == (ib, 0, 4096)
        assert sorted(c[1:4] for c in calls[1:]) == sorted([(ia, 0, 3 << 20), (ib, 4096, 4096)])
    finally:
        hold.set()
        writeback._sync_file_range = real
        a.discard()
        b.discard()


def test_a_request_names_its_file_even_when_the_number_is_reused(tmp_path, monkeypatch):
    """The file is published (closed) while its request is being made, and a new file
    takes the same descriptor number: the call still reaches the first file's pages."""
    first = TempFile(tmp_path / "chunk-0-0.bin", 4096)
    first.pwrite(b"x" * 4096, 0)
    first_ino, number = os.fstat(first.fd).st_ino, first.fd
    real = writeback._sync_file_range
    assert real is not None
    reached: list[int] = []
    second: list[TempFile] = []

    def interleaved(fd: int, offset: int, nbytes: int, flags: int) -> int:
        first.publish()  # closed after the thread looked at it, before the call
        second.append(TempFile(tmp_path / "chunk-0-1.bin", 4096))
        assert second[0].fd == number  # the number now names another file
        reached.append(os.fstat(fd).st_ino)
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "_sync_file_range", interleaved)
    try:
        before = forksafe.tracked_fds()
        assert writeback.request_writeback(first, 0, 4096)
        assert writeback.flush(10)
        assert reached == [first_ino]
        assert os.fstat(second[0].fd).st_ino != first_ino
        assert forksafe.tracked_fds() == before  # the number is second's; the duplicate closed
    finally:
        first.discard()
        for tmp in second:
            tmp.discard()


def test_a_forked_child_gets_a_writeback_thread_of_its_own(tmp_path, calls):
    tmp = TempFile(tmp_path / "chunk-0-0.bin", 4096)
    try:
        assert writeback.request_writeback(tmp, 0, 4096)  # the parent's thread runs
        assert writeback.flush(10)
        assert len(calls) == 1
        parent = writeback._get()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                fd = os.open(tmp_path / "child.bin", os.O_RDWR | os.O_CREAT)
                os.pwrite(fd, b"y" * 4096, 0)

                class Out:
                    pass

                out = Out()
                out.fd = fd  # type: ignore[attr-defined]
                ok = writeback.request_writeback(out, 0, 4096)  # type: ignore[arg-type]
                ok = ok and writeback.flush(10)  # the parent's thread does not exist here
                ok = ok and writeback._get() is not parent and not parent.queue
                os.write(w, b"ok" if ok and len(calls) == 2 else b"no")
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        got = os.read(r, 2)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert got == b"ok"
        assert writeback._get() is parent
    finally:
        tmp.discard()


def test_the_queue_is_bounded(tmp_path, calls, monkeypatch):
    monkeypatch.setattr(writeback, "MAX_QUEUED", 2)
    hold = threading.Event()
    real = writeback._sync_file_range
    tmp = TempFile(tmp_path / "chunk-0-0.bin", 1 << 20)
    try:

        def blocked(fd: int, offset: int, nbytes: int, flags: int) -> int:
            hold.wait(10)
            return real(fd, offset, nbytes, flags)

        writeback._sync_file_range = blocked
        assert writeback.request_writeback(tmp, 0, 4096)
        while writeback._get().queue:
            threading.Event().wait(0.001)
        before = forksafe.tracked_fds()
        assert writeback.request_writeback(tmp, 8192, 4096)
        assert writeback.request_writeback(tmp, 16384, 4096)
        assert not writeback.request_writeback(tmp, 32768, 4096)  # dropped, no descriptor
        assert len(forksafe.tracked_fds() - before) == 2
        hold.set()
        assert writeback.flush(10)
        assert not forksafe.tracked_fds() - before
    finally:
        hold.set()
        writeback._sync_file_range = real
        tmp.discard()
