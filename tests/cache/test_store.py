"""The cache directory: atomic publish, orphan sweep, locks, pins and LRU eviction."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import textwrap
import time

import pytest

from asynccache.cache import ChunkStore, FileLock, TempFile, dataset_dir, sweep_orphans
from asynccache.cache.layout import is_temp_name
from asynccache.errors import CacheError

pytestmark = pytest.mark.timeout(30)


def _publish(store: ChunkStore, name: str, data: bytes) -> None:
    tmp = store.create_temp(name, len(data))
    tmp.pwrite(data, 0)
    tmp.publish()


def test_dataset_dir_changes_with_the_index_checksum(tmp_path) -> None:
    a = dataset_dir(tmp_path, "s3://b/ds", "aaaa")
    assert a == dataset_dir(tmp_path, "s3://b/ds", "aaaa")
    assert a != dataset_dir(tmp_path, "s3://b/ds", "bbbb")
    assert a != dataset_dir(tmp_path, "s3://b/other", "aaaa")
    assert a.parent == tmp_path


def test_publish_is_atomic_and_leaves_no_temp(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    tmp = store.create_temp("chunk-0-2.bin", 8)
    assert is_temp_name(tmp.path.name) and f".{os.getpid()}." in tmp.path.name
    tmp.pwrite(b"5678", 4)
    tmp.pwrite(b"1234", 0)
    assert not store.is_cached("chunk-0-2.bin")
    tmp.publish()
    assert (tmp_path / "ds" / "chunk-0-2.bin").read_bytes() == b"12345678"
    assert [p.name for p in (tmp_path / "ds").iterdir() if p.is_file()] == ["chunk-0-2.bin"]


def test_discard_removes_the_temp(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    tmp = store.create_temp("chunk-0-2.bin", 8)
    tmp.discard()
    tmp.discard()
    assert not any(p.is_file() for p in (tmp_path / "ds").iterdir())


def test_sweep_removes_only_orphans(tmp_path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    # a writer that dies mid-write: its flock goes with it
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from asynccache.cache.layout import TempFile
        t = TempFile(Path({str(root)!r}) / "dead.bin", 100)
        t.pwrite(b"x" * 10, 0)
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    live = TempFile(root / "live.bin", 100)
    names = sorted(p.name for p in root.iterdir())
    assert len(names) == 2
    removed = sweep_orphans(root)
    assert len(removed) == 1 and removed[0].startswith(".dead.bin.")
    assert [p.name for p in root.iterdir()] == [live.path.name]
    live.discard()


def test_disk_full_is_a_cache_error_naming_the_dir(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 62)
    with pytest.raises(CacheError) as info:
        store.create_temp("huge.bin", 1 << 55)
    assert str(tmp_path / "ds") in str(info.value)
    assert not any(p.is_file() for p in (tmp_path / "ds").iterdir())


def test_pin_unpin_counts(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    assert store.pin("missing.bin") is None
    _publish(store, "chunk-0-0.bin", b"a" * 10)
    assert store.pin("chunk-0-0.bin") == str(tmp_path / "ds" / "chunk-0-0.bin")
    assert store.pin("chunk-0-0.bin") is not None
    assert store.pinned() == {"chunk-0-0.bin": 2}
    store.unpin("chunk-0-0.bin")
    store.unpin("chunk-0-0.bin")
    assert store.pinned() == {}
    with pytest.raises(CacheError):
        store.unpin("chunk-0-0.bin")


async def test_lru_eviction_keeps_pinned_chunks(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=300)
    other = ChunkStore(tmp_path / "ds", max_cache_bytes=300)  # another process's view
    for i, name in enumerate(["chunk-0-0.bin", "chunk-0-1.bin", "chunk-0-2.bin"]):
        _publish(store, name, b"x" * 100)
        os.utime(store.path(name), (1000 + i, 1000 + i))
    assert other.pin("chunk-0-0.bin")  # oldest, but pinned (by a different open file)
    removed = await store.make_room(150)
    assert removed == 200
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if p.is_file()) == ["chunk-0-0.bin"]
    other.unpin("chunk-0-0.bin")
    assert await store.make_room(300) == 100
    assert store.used_bytes() == 0


async def test_pin_touches_lru_order(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=200)
    for i, name in enumerate(["chunk-0-0.bin", "chunk-0-1.bin"]):
        _publish(store, name, b"x" * 100)
        os.utime(store.path(name), (1000 + i, 1000 + i))
    store.pin("chunk-0-0.bin")
    store.unpin("chunk-0-0.bin")  # a is now the most recently used
    await store.make_room(100)
    assert store.is_cached("chunk-0-0.bin") and not store.is_cached("chunk-0-1.bin")


async def test_lock_waits_without_polling_and_is_bounded(tmp_path) -> None:
    path = str(tmp_path / "x.lock")
    holder = FileLock(path, timeout=1)
    await holder.acquire()
    with pytest.raises(CacheError, match="waited"):
        async with FileLock(path, timeout=0.2):
            pass
    waiter = asyncio.ensure_future(FileLock(path, timeout=5).acquire())
    await asyncio.sleep(0.1)
    assert not waiter.done()
    t0 = time.monotonic()
    holder.release()
    await asyncio.wait_for(waiter, 5)
    assert time.monotonic() - t0 < 1.0


async def test_cancelled_lock_wait_leaks_nothing(tmp_path) -> None:
    path = str(tmp_path / "x.lock")
    holder = FileLock(path, timeout=1)
    await holder.acquire()
    fds_before = len(os.listdir("/proc/self/fd"))
    waiter = asyncio.ensure_future(FileLock(path, timeout=5).acquire())
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    holder.release()
    for _ in range(50):  # the abandoned waiter thread closes its descriptor once granted
        if len(os.listdir("/proc/self/fd")) <= fds_before - 1:
            break
        await asyncio.sleep(0.02)
    assert len(os.listdir("/proc/self/fd")) <= fds_before - 1
    async with FileLock(path, timeout=1):
        pass


def test_forked_child_drops_inherited_pins(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=100)
    _publish(store, "chunk-0-0.bin", b"x" * 100)
    assert store.pin("chunk-0-0.bin")
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pins of its own; stays alive until the parent has checked
        try:
            os.close(report_r)
            os.close(go_w)
            os.write(report_w, b"0" if store.pinned() == {} else b"1")
            os.read(go_r, 1)  # blocks until the parent writes or exits
        finally:
            os._exit(0)
    os.close(report_w)
    os.close(go_r)
    try:
        assert os.read(report_r, 1) == b"0"  # the child has started and has no pins
        assert store.pinned() == {"chunk-0-0.bin": 1}
        other = ChunkStore(tmp_path / "ds", max_cache_bytes=100)
        assert asyncio.run(other.make_room(100)) == 0  # still pinned by us
        store.unpin("chunk-0-0.bin")
        # The child is alive (blocked on the pipe) and must not hold our pin's lock.
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
        assert asyncio.run(other.make_room(100)) == 100
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.close(go_w)  # EOF: the child exits
        os.close(report_r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


async def test_unpin_trims_a_cache_left_over_budget_by_pins(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=200)
    for name in ["chunk-0-0.bin", "chunk-0-1.bin"]:
        _publish(store, name, b"x" * 100)
        assert store.pin(name)
    tmp = await store.reserve("chunk-0-2.bin", 100)  # nothing evictable: over budget by 100
    tmp.pwrite(b"y" * 100, 0)
    tmp.publish()
    assert store.used_bytes() == 300
    store.unpin("chunk-0-0.bin")
    assert store.used_bytes() == 200 and not store.is_cached("chunk-0-0.bin")
    store.unpin("chunk-0-1.bin")


def test_for_dataset_uses_settings(tmp_path) -> None:
    from asynccache.config import Settings

    settings = Settings(cache_dir=str(tmp_path), max_cache_bytes=12345)
    store = ChunkStore.for_dataset(settings, "s3://b/ds", "abcd")
    assert store.root == dataset_dir(tmp_path, "s3://b/ds", "abcd")
    assert store.max_cache_bytes == 12345 and store.cache_dir == tmp_path


def test_close_trims_what_its_pins_kept_over_budget(tmp_path, monkeypatch) -> None:
    """An unpin trims the cache, but gives up when another process holds the eviction
    lock past a short wait (the next reservation trims then). A store closed with pins
    releases them all at once: it trims too, so no dataset is left over its budget at rest
    because its reader's last pins went with the close."""
    from asynccache.cache import store as store_mod

    monkeypatch.setattr(store_mod, "_TRIM_WAIT_S", 0.05)
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=250)
    for i, name in enumerate(["chunk-0-0.bin", "chunk-0-1.bin", "chunk-0-2.bin"]):
        _publish(store, name, b"x" * 100)
        os.utime(store.path(name), (1000 + i, 1000 + i))
    assert store.pin("chunk-0-2.bin")
    holder = os.open(store.cache_dir / store_mod.EVICT_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another process evicting, for longer than the wait
    assert store.pin("chunk-0-0.bin")
    store.unpin("chunk-0-0.bin")
    assert store.used_bytes() == 300, "the unpin's trim gave up (the lock is held)"
    fcntl.flock(holder, fcntl.LOCK_UN)
    os.close(holder)
    store.close()  # releases chunk-0-2's pin
    assert store.used_bytes() <= 250
    assert store.is_cached("chunk-0-2.bin"), "the most recently used is kept"


async def test_a_hand_over_holds_the_chunk_until_the_readers_pin_takes_it(tmp_path) -> None:
    """The pin taken for a waiting reader keeps another process's evictor off the chunk;
    the reader's pin takes it over (one pin, one unpin, then evictable). Two readers
    waiting for one chunk: two hand-overs, two pins."""
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    other = ChunkStore(tmp_path / "ds", max_cache_bytes=100)  # another process's view
    _publish(store, "chunk-0-0.bin", b"x" * 100)
    assert store.hand_over("chunk-0-0.bin") and store.hand_over("chunk-0-0.bin")
    assert store.pinned() == {"chunk-0-0.bin": 2}
    assert await other.make_room(100) == 0, "handed over: pinned"
    assert store.pin("chunk-0-0.bin") and store.pin("chunk-0-0.bin")
    assert store.pinned() == {"chunk-0-0.bin": 2}, "the readers' pins took the hand-overs"
    assert store.pin("chunk-0-0.bin")
    assert store.pinned() == {"chunk-0-0.bin": 3}, "a third pin is a pin of its own"
    for _ in range(3):
        store.unpin("chunk-0-0.bin")
    assert store.pinned() == {}
    assert await other.make_room(100) == 100
    assert not store.hand_over("chunk-0-0.bin"), "nothing to hand over"
    assert store.pinned() == {}
    assert store.pin("chunk-0-0.bin") is None


async def test_a_hand_over_nobody_takes_is_released_in_time(tmp_path, monkeypatch) -> None:
    """A reader that gave up never pins: its hand-over is released once stale, at this
    store's next eviction, and the chunk is evictable again (not before)."""
    from asynccache.cache import store as store_mod

    store = ChunkStore(tmp_path / "ds", max_cache_bytes=100)
    _publish(store, "chunk-0-0.bin", b"x" * 100)
    _publish(store, "chunk-0-1.bin", b"y" * 100)
    assert store.pin("chunk-0-1.bin")
    assert store.hand_over("chunk-0-1.bin")  # on a pin of its own: two, one handed
    assert store.hand_over("chunk-0-0.bin")
    assert await store.make_room(100) == 0, "both pinned"
    monkeypatch.setattr(store_mod.time, "monotonic", lambda: time.monotonic_ns() / 1e9 + 60)
    assert await store.make_room(100) == 100
    assert not store.is_cached("chunk-0-0.bin"), "its stale hand-over released"
    assert store.pinned() == {"chunk-0-1.bin": 1}, "the reader's own pin stays"
    assert store.pin("chunk-0-1.bin") and store.pinned() == {"chunk-0-1.bin": 2}


async def test_a_closed_store_takes_no_hand_over(tmp_path) -> None:
    """A download that lands after the close hands over nothing: no reader would take
    that pin over, and no pin or eviction of the closed store would release it, so
    other processes could never evict the chunk while this one lives."""
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    other = ChunkStore(tmp_path / "ds", max_cache_bytes=100)  # another process's view
    _publish(store, "chunk-0-0.bin", b"x" * 100)
    _publish(store, "chunk-0-1.bin", b"y" * 100)
    assert store.hand_over("chunk-0-0.bin")
    store.close()
    assert store.pinned() == {}
    assert not store.hand_over("chunk-0-1.bin")
    assert store.pinned() == {}
    assert await other.make_room(0) == 100, "both evictable: the budget holds one"
    assert await other.make_room(100) == 100


def test_a_forked_child_takes_over_no_hand_over_of_its_parent(tmp_path) -> None:
    """The parent's hand-overs are its own: in a forked child, a pin is a pin of its own
    (its second pin counts two), and the parent's hand-over is there for its reader."""
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    _publish(store, "chunk-0-0.bin", b"x" * 100)
    assert store.hand_over("chunk-0-0.bin")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            fresh = store.pinned() == {}
            store.pin("chunk-0-0.bin")
            store.pin("chunk-0-0.bin")
            ok = fresh and store.pinned() == {"chunk-0-0.bin": 2}
            os.write(w, b"0" if ok else b"1")
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"0"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert store.pin("chunk-0-0.bin") and store.pinned() == {"chunk-0-0.bin": 1}
