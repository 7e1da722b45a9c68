"""The main process's keeper of the publishes its DataLoader workers leave
(asynccache/download/handoff.py), with real forked senders: it finishes the publish of a
sender that died, never one its sender removed, and leaves a live sender's to it."""

from __future__ import annotations

import fcntl
import multiprocessing
import os

import pytest

from asynccache.cache.locks import try_lock
from asynccache.download import handoff

pytestmark = pytest.mark.skipif(not handoff.supported(), reason="Linux only")

DATA = os.urandom(1 << 16)


def _files(tmp_path):  # type: ignore[no-untyped-def]
    return (
        str(tmp_path / ".chunk-0-0.bin.1.0badcafe.tmp"),
        str(tmp_path / "chunk-0-0.bin"),
        str(tmp_path / "chunk-0-0.bin.lock"),
    )


def _sender(address: str, tmp: str, final: str, lock: str, then: str, go) -> None:  # type: ignore[no-untyped-def]
    """A writer as the downloader is at the end of a worker's iteration: the file
    written and verified, both flocks held; hands them over, then ``then``."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, DATA)
    lfd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lfd, fcntl.LOCK_EX)
    assert handoff.send(address, os.getpid(), [handoff.Handed(tmp, final, True, fd, lfd)])
    if then == "discard":  # its publish failed: the file is removed
        os.unlink(tmp)
    elif then == "publish":  # it publishes itself and lives on
        os.fsync(fd)
        os.replace(tmp, final)
        go.wait(30)
    os._exit(0)  # killed mid-publish, as torch ends a worker


@pytest.mark.parametrize("then", ["die", "discard", "publish"])
def test_keeper(tmp_path, then):  # type: ignore[no-untyped-def]
    keeper = handoff.keeper(30.0)
    assert keeper is not None
    tmp, final, lock = _files(tmp_path)
    received, published = keeper.received, keeper.published
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    p = ctx.Process(target=_sender, args=(keeper.address, tmp, final, lock, then, go))
    p.start()
    try:
        if then == "publish":
            while not os.path.exists(final):  # bounded by the join below failing the test
                assert p.is_alive(), "the sender died before publishing"
                os.sched_yield()
            assert keeper.wait(30)  # it let go once the sender published
            assert p.is_alive(), "the sender was to be alive while the keeper let go"
        go.set()
        p.join(30)
        assert p.exitcode == 0
        assert keeper.wait(30)
    finally:
        go.set()
        p.join(5)
    assert keeper.received == received + 1
    assert not os.path.exists(tmp), "a temporary file was left behind"
    if then == "discard":
        assert not os.path.exists(final), "a file its sender removed was published"
        assert keeper.published == published
    else:
        with open(final, "rb") as f:
            assert f.read() == DATA
        assert keeper.published == published + (then == "die")
    # Every lock the keeper held is released.
    fd = os.open(lock, os.O_RDWR)
    try:
        assert try_lock(fd, exclusive=True)
    finally:
        os.close(fd)


@pytest.mark.parametrize("lie", ["pid", "path", "elsewhere"])
def test_keeper_refuses_what_it_must_not_act_on(tmp_path, lie):  # type: ignore[no-untyped-def]
    """Any local process can connect to an abstract socket: a hand-off naming another
    process, or a file that is not a chunk's temporary file beside its final name, is
    refused, and the keeper keeps none of its descriptors."""
    keeper = handoff.keeper(30.0)
    assert keeper is not None
    tmp, final, lock = _files(tmp_path)
    if lie == "path":
        tmp = str(tmp_path / "notes.txt")
    elif lie == "elsewhere":
        final = str(tmp_path / "sub" / "chunk-0-0.bin")
    pid = os.getpid() + (1 if lie == "pid" else 0)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    lfd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lfd, fcntl.LOCK_EX)
    received = keeper.received
    try:
        assert not handoff.send(
            address=keeper.address, pid=pid, items=[handoff.Handed(tmp, final, True, fd, lfd)]
        )
    finally:
        os.close(fd)
        os.close(lfd)
    assert keeper.received == received
    assert keeper.wait(5)
    for path in (tmp, lock):  # no copy of the sender's descriptors left in the keeper
        probe = os.open(path, os.O_RDWR)
        try:
            assert try_lock(probe, exclusive=True), f"the keeper kept {path}'s lock"
        finally:
            os.close(probe)
    assert os.path.exists(tmp) and not os.path.exists(final)
