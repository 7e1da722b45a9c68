"""A chunk published while a scan lists its directory is counted (its temporary name
listed, gone by the time the scan looks at it): a scan that missed it let the cache go
one chunk over its budget, and stay there."""

from __future__ import annotations

import asyncio
import fcntl
import os

import pytest

from asynccache.cache import ChunkStore, usage
from asynccache.cache.store import EVICT_LOCK

pytestmark = pytest.mark.timeout(60)

SIZE = 1000


class _PublishAfterListing:
    """``os.scandir`` of ``root`` that runs ``then`` once its entries are listed, before
    the caller looks at any of them (a publish landing in that gap)."""

    def __init__(self, monkeypatch, root, then) -> None:
        self.root, self.then, self.fired = os.fspath(root), then, 0
        self.scandir = os.scandir
        monkeypatch.setattr(os, "scandir", self)

    def __call__(self, path=".", *args, **kwargs):
        it = self.scandir(path, *args, **kwargs)
        if os.fspath(path) != self.root or self.fired:
            return it
        with it:
            listed = list(it)
        self.fired += 1
        self.then()
        return _Listed(listed)


class _Listed(list):
    def __enter__(self):
        return iter(self)

    def __exit__(self, *exc) -> None:
        return None


async def _filled(store: ChunkStore, name: str):
    tmp = await store.reserve(name, SIZE)
    tmp.pwrite(b"x" * SIZE, 0)
    return tmp


def test_a_scan_counts_a_chunk_published_after_its_listing(tmp_path, monkeypatch) -> None:
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=10 * SIZE)
    tmp = asyncio.run(_filled(store, "chunk-0-0.bin"))
    race = _PublishAfterListing(monkeypatch, store.root, tmp.publish)
    used, entries, _ = usage.scan(store.cache_dir, store.root)
    monkeypatch.undo()
    assert race.fired == 1
    assert store.path("chunk-0-0.bin").exists()
    assert used == SIZE
    assert [os.path.basename(e.key) for e in entries] == ["chunk-0-0.bin"]


def test_the_budget_holds_when_a_chunk_is_published_during_an_evictions_scan(
    tmp_path, monkeypatch
) -> None:
    budget = 3 * SIZE
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=budget)

    async def run() -> None:
        for i in range(2):
            (await _filled(store, f"chunk-0-{i}.bin")).publish()
        third = await _filled(store, "chunk-0-2.bin")  # the budget now full
        # The fourth must evict; the third is published while that eviction's scan lists.
        race = _PublishAfterListing(monkeypatch, store.root, third.publish)
        fourth = await store.reserve("chunk-0-3.bin", SIZE)
        monkeypatch.undo()
        assert race.fired == 1
        fourth.pwrite(b"x" * SIZE, 0)
        fourth.publish()

    asyncio.run(run())
    on_disk = sorted(p.name for p in store.root.glob("chunk-*.bin"))
    assert len(on_disk) * SIZE <= budget, on_disk
    assert "chunk-0-3.bin" in on_disk
    assert store.used_bytes() <= budget


def test_a_chunk_published_and_evicted_between_a_settle_and_the_next_is_taken_off_once(
    tmp_path, monkeypatch
) -> None:
    """A reservation's settle finds a download live; it publishes before that reservation's
    scan, which counts the chunk and evicts it. The next settle must not take the chunk's
    bytes off the ledger a second time: the ledger then counted one chunk less than the
    cache held, and a later reservation, trusting it, went one chunk over the budget."""
    budget = 3 * SIZE
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=budget)
    settle = usage.settle
    fired = []

    async def run() -> None:
        for i in range(2):
            (await _filled(store, f"chunk-0-{i}.bin")).publish()
        third = await _filled(store, "chunk-0-2.bin")  # the budget now full

        def publish_after(fd, base):
            settled = settle(fd, base)
            if not fired:
                fired.append(third.path)
                third.publish()
                # The oldest: the eviction the next reservation makes takes it.
                os.utime(store.path("chunk-0-2.bin"), (1, 1))
            return settled

        monkeypatch.setattr(usage, "settle", publish_after)
        (await _filled(store, "chunk-0-3.bin")).publish()
        monkeypatch.undo()
        assert fired and not store.path("chunk-0-2.bin").exists()  # published, then evicted
        (await _filled(store, "chunk-0-4.bin")).publish()

    asyncio.run(run())
    on_disk = sorted(p.name for p in store.root.glob("chunk-*.bin"))
    assert len(on_disk) * SIZE <= budget, on_disk
    assert "chunk-0-4.bin" in on_disk


def test_a_settle_that_looks_as_a_chunk_is_published_keeps_its_bytes(tmp_path, monkeypatch) -> None:
    """A reservation's settle opens a download's temporary file; the download publishes
    and lets go of its lock before the settle tries that lock. The file is the chunk now,
    not a dead writer's: its bytes stay on the ledger. (They were taken off: the ledger
    counted one chunk less than the cache held, and the reservations trusting it went
    one chunk over the budget.)"""
    budget = 3 * SIZE
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=budget)
    try_lock = usage.try_lock
    fired = []

    async def run() -> None:
        (await _filled(store, "chunk-0-0.bin")).publish()
        second = await _filled(store, "chunk-0-1.bin")

        def publish_first(fd, exclusive):
            if not fired:
                fired.append(second.path)
                second.publish()  # renamed, and its lock let go
            return try_lock(fd, exclusive=exclusive)

        monkeypatch.setattr(usage, "try_lock", publish_first)
        third = await _filled(store, "chunk-0-2.bin")  # its settle looks at the second
        monkeypatch.undo()
        assert fired and store.path("chunk-0-1.bin").exists()
        third.publish()
        (await _filled(store, "chunk-0-3.bin")).publish()  # must evict: the budget is full

    asyncio.run(run())
    on_disk = sorted(p.name for p in store.root.glob("chunk-*.bin"))
    assert len(on_disk) * SIZE <= budget, on_disk
    assert "chunk-0-3.bin" in on_disk


def test_a_publish_survives_a_lock_conversion_that_lets_a_settle_in(tmp_path, monkeypatch) -> None:
    """flock(2) does not promise that converting a lock is atomic: older kernels drop the
    old lock, reschedule, then take the new one. A settle that runs in that gap of a
    publish must not take the download's file for a dead writer's (it removed the file,
    the rename failed, and the reader got an error): the rename happens under the
    exclusive lock, and the conversion after it."""
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=10 * SIZE)
    tmp = asyncio.run(_filled(store, "chunk-0-0.bin"))
    flock = fcntl.flock
    fired = []

    def converting(fd, op):
        if fd == tmp.fd and op == fcntl.LOCK_SH and not fired:
            flock(fd, fcntl.LOCK_UN)  # the old lock goes first...
            lock = os.open(store.cache_dir / EVICT_LOCK, os.O_RDWR)
            try:
                flock(lock, fcntl.LOCK_EX)
                fired.append(usage.settle(lock, store.cache_dir))  # ...a settle runs...
            finally:
                os.close(lock)
        return flock(fd, op)  # ...then the new one is taken

    monkeypatch.setattr(fcntl, "flock", converting)
    tmp.publish()
    monkeypatch.undo()
    assert fired, "the settle ran in the conversion's gap"
    assert store.path("chunk-0-0.bin").read_bytes() == b"x" * SIZE
    assert fired[0].pending == [], "settled as published"
    assert store.used_bytes() == SIZE
    lock = os.open(store.cache_dir / EVICT_LOCK, os.O_RDWR)
    try:
        ledger = usage.read_ledger(lock)
    finally:
        os.close(lock)
    assert ledger is not None and ledger.used == SIZE, "its bytes stay counted"


def test_a_settle_that_cannot_look_at_a_final_name_keeps_counting_the_entry(
    tmp_path, monkeypatch
) -> None:
    """A pending entry's temporary file is gone, and its chunk's name can't be looked at
    (permission, I/O error): the settle keeps the entry counted, as for a file it can't
    open (errs high), where it raised that error before."""
    from asynccache.cache.fsutil import temp_name

    base = str(tmp_path)
    final = os.path.join(base, "chunk-0-1.bin")
    tmp = temp_name(final)
    fd = os.open(tmp, os.O_CREAT | os.O_RDWR, 0o600)
    entry = usage.pending_of(tmp, fd, 1000, base)
    os.close(fd)
    os.unlink(tmp)
    lock = os.open(os.path.join(base, "lock"), os.O_CREAT | os.O_RDWR, 0o600)
    usage.write_pending(lock, [entry])
    looked: list[str] = []
    real = os.stat

    def stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.fspath(path) == final:
            looked.append(final)
            raise PermissionError(13, "Permission denied", final)
        return real(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(usage.os, "stat", stat)
        settled = usage.settle(lock, base)
    os.close(lock)
    assert looked, "the settle looked at the chunk's name"
    assert settled.pending == [entry] and settled.unallocated == 1000
