"""download.writeback: early writeback is asked from a thread of its own, never the caller's."""

from __future__ import annotations

import os
import threading

import pytest

from asynccache.cache.layout import TempFile
from asynccache.download import writeback

pytestmark = pytest.mark.skipif(
    writeback._sync_file_range is None, reason="sync_file_range is Linux only"
)


@pytest.fixture
def calls(monkeypatch):
    """Every sync_file_range call: (thread name, fd, offset, nbytes, flags)."""
    seen: list[tuple[str, int, int, int, int]] = []
    real = writeback._sync_file_range
    assert real is not None

    def record(fd: int, offset: int, nbytes: int, flags: int) -> int:
        seen.append((threading.current_thread().name, fd, offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "_sync_file_range", record)
    return seen


def test_a_request_runs_on_the_writeback_thread_not_the_callers(tmp_path, calls):
    tmp = TempFile(tmp_path / "chunk-0-0.bin", 1 << 20)
    try:
        tmp.pwrite(b"x" * (1 << 20), 0)
        fut = writeback.request_writeback(tmp, 0, 1 << 20)
        assert fut is not None
        fut.result(timeout=10)
        assert len(calls) == 1
        name, fd, offset, nbytes, flags = calls[0]
        assert name.startswith("asynccache-writeback") and name != threading.current_thread().name
        assert (fd, offset, nbytes, flags) == (tmp.fd, 0, 1 << 20, 2)
    finally:
        tmp.discard()


def test_a_request_for_a_closed_file_asks_nothing(tmp_path, calls):
    tmp = TempFile(tmp_path / "chunk-0-0.bin", 4096)
    tmp.discard()  # published or discarded before the thread got to it
    fut = writeback.request_writeback(tmp, 0, 4096)
    assert fut is not None
    fut.result(timeout=10)
    assert calls == []
    assert writeback.request_writeback(tmp, 0, 0) is None


def test_a_forked_child_gets_a_writeback_thread_of_its_own(tmp_path, calls):
    tmp = TempFile(tmp_path / "chunk-0-0.bin", 4096)
    try:
        writeback.request_writeback(tmp, 0, 4096).result(timeout=10)  # the parent's thread runs
        assert len(calls) == 1
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
                fut = writeback.request_writeback(out, 0, 4096)  # type: ignore[arg-type]
                fut.result(timeout=10)  # the parent's thread does not exist here
                os.write(w, b"ok" if len(calls) == 2 else b"no")
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        got = os.read(r, 2)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert got == b"ok"
    finally:
        tmp.discard()
