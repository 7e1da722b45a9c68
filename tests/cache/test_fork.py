"""A child process never keeps a lock of its parent alive (issue 9, point 2).

Each test runs under the fork, forkserver and spawn start methods. The child is started
while the parent holds the lock and is kept alive (blocked on an event) while the parent
releases and a third party takes the lock: the parent and others must not wait on it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
from fork_support import live_child, lock_is_free

from asynccache.cache import ChunkStore, FileLock, sweep_orphans

pytestmark = pytest.mark.timeout(60)

METHODS = ["fork", "forkserver", "spawn"]
_BOUND_S = 30.0
_HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.fixture(params=METHODS)
def ctx(request):
    return multiprocessing.get_context(request.param)


def _publish(store: ChunkStore, name: str, size: int) -> None:
    tmp = store.create_temp(name, size)
    tmp.pwrite(b"x" * size, 0)
    tmp.publish()


def test_download_lock_held_at_fork(tmp_path, ctx) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    lock = store.download_lock("chunk-0-0.bin")
    asyncio.run(lock.acquire())
    with live_child(ctx) as child:
        lock.release()
        assert child.is_alive()
        assert lock_is_free(store.lock_path("chunk-0-0.bin"))
        assert child.is_alive()


def test_lock_granted_to_a_waiting_thread_after_fork(tmp_path, ctx) -> None:
    path = str(tmp_path / "x.lock")
    # The first holder is another process, so no child of ours can inherit its lock.
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    lock = FileLock(path, timeout=_BOUND_S)
    waiter = threading.Thread(target=asyncio.run, args=(lock.acquire(),), daemon=True)
    waiter.start()
    deadline = time.monotonic() + _BOUND_S
    while not any(t.name == "asynccache-flock" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the waiting thread never blocked"
        time.sleep(0.01)
    with live_child(ctx) as child:  # forked while the helper thread blocks in flock
        holder.communicate(b"\n", timeout=_BOUND_S)  # it exits: the waiter is granted
        waiter.join(_BOUND_S)
        assert not waiter.is_alive()
        lock.release()
        assert child.is_alive()
        assert lock_is_free(path)
        assert child.is_alive()


def test_evict_lock_held_at_fork(tmp_path, ctx, monkeypatch) -> None:
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=100)
    _publish(store, "chunk-0-0.bin", 100)
    in_scan, proceed = threading.Event(), threading.Event()
    scandir = os.scandir
    cache_dir = str(store.cache_dir)

    def slow_scandir(path=".", *args, **kwargs):
        # the evictor lists the cache dir while it holds the evict lock: pause it there
        if str(path) == cache_dir and threading.current_thread() is not threading.main_thread():
            in_scan.set()
            proceed.wait(_BOUND_S)
        return scandir(path, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", slow_scandir)
    evictor = threading.Thread(target=asyncio.run, args=(store.make_room(50),), daemon=True)
    evictor.start()
    assert in_scan.wait(_BOUND_S)
    with live_child(ctx) as child:  # forked while another thread holds the evict lock
        proceed.set()
        evictor.join(_BOUND_S)
        assert not evictor.is_alive()
        monkeypatch.undo()
        assert child.is_alive()
        assert lock_is_free(store.cache_dir / ".evict.lock")
        assert child.is_alive()


def test_published_temp_is_evictable_while_a_child_lives(tmp_path, ctx) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    tmp = store.create_temp("chunk-0-0.bin", 100)
    tmp.pwrite(b"x" * 100, 0)
    with live_child(ctx) as child:
        tmp.publish()  # the writer's lock is gone with its descriptor: nobody pins it
        evictor = ChunkStore(tmp_path / "ds", max_cache_bytes=0)
        assert asyncio.run(evictor.make_room(0)) == 100
        assert not store.is_cached("chunk-0-0.bin")
        assert child.is_alive()


def test_abandoned_temp_is_swept_while_a_child_lives(tmp_path, ctx) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    tmp = store.create_temp("chunk-0-0.bin", 100)
    with live_child(ctx) as child:
        tmp._close()  # the writer lets go without removing it, as a dead writer would
        assert sweep_orphans(store.root) == [tmp.path.name]
        assert child.is_alive()


def test_unpinned_chunk_is_evictable_while_a_child_lives(tmp_path, ctx) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    _publish(store, "chunk-0-0.bin", 100)
    assert store.pin("chunk-0-0.bin")
    with live_child(ctx) as child:
        store.unpin("chunk-0-0.bin")
        evictor = ChunkStore(tmp_path / "ds", max_cache_bytes=0)
        assert asyncio.run(evictor.make_room(0)) == 100
        assert child.is_alive()
