"""A wait for another process's lock says who holds it: in the log once it has lasted a
while, and in the error when it runs out. The holder is a real process."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from asynccache.cache import locks
from asynccache.errors import CacheError

_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()  # until the test closes the pipe
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/locks is Linux's")
def test_a_long_wait_names_the_holder(tmp_path, monkeypatch, caplog) -> None:
    path = str(tmp_path / "chunk-0-0.bin.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        monkeypatch.setattr(locks, "_WARN_AFTER_S", 0.05)
        fd = locks.open_lock_file(path)
        with (
            caplog.at_level(logging.WARNING, logger=locks.__name__),
            pytest.raises(CacheError) as err,
        ):
            asyncio.run(locks.wait_lock(fd, True, 0.3, path))
        said = [r.getMessage() for r in caplog.records if r.name == locks.__name__]
        assert len(said) == 1, said  # said once, then the wait goes on to its bound
        for text in (said[0], str(err.value)):
            assert path in text and f"pid {holder.pid}" in text, text
    finally:
        holder.kill()
        holder.wait(10)


def test_a_short_wait_says_nothing(tmp_path, caplog) -> None:
    """Granted before the warning's time: no log line, the lock held."""
    path = str(tmp_path / "free.lock")
    fd = locks.open_lock_file(path)
    with caplog.at_level(logging.WARNING, logger=locks.__name__):
        asyncio.run(locks.wait_lock(fd, True, 5.0, path))
    try:
        assert not [r for r in caplog.records if r.name == locks.__name__]
        probe = locks.open_lock_file(path)
        try:
            assert not locks.try_lock(probe, exclusive=True)
        finally:
            locks.forksafe.close_fd(probe)
    finally:
        locks.forksafe.close_fd(fd)
