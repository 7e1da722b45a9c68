"""Downloader behaviour against an in-memory storage: hits, single-flight, parts, retries."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import xxhash
from dl_support import DictStorage

from asynccache.bridge import LoopThread
from asynccache.cache import ChunkStore
from asynccache.cache.layout import local_name
from asynccache.config import Settings
from asynccache.download import ChunkSpec, Downloader, prefetch_dataset
from asynccache.errors import (
    AuthError,
    ChecksumMismatchError,
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorageTimeoutError,
    TransientError,
)
from asynccache.storage.base import Storage

pytestmark = pytest.mark.timeout(30)


def _settings(tmp_path, **kw) -> Settings:
    base = dict(
        cache_dir=str(tmp_path),
        retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        timeout_s=2.0,
        part_bytes=1 << 20,
        max_concurrency=4,
        prefetch_chunks=2,
    )
    base.update(kw)
    return Settings(**base)


def _objects(n: int, size: int) -> dict[str, bytes]:
    return {f"c{i}.bin": os.urandom(size) for i in range(n)}


def _xx(data: bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def _make(tmp_path, lt, objects, **kw):
    storage = DictStorage(objects)
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=kw.pop("budget", 1 << 30))
    return storage, store, Downloader(storage, store, _settings(tmp_path, **kw), loop_thread=lt)


def _files(store: ChunkStore) -> list[str]:
    # The store names a chunk's file itself (local_name): back to the names used here.
    back = {local_name(f"c{i}.bin"): f"c{i}.bin" for i in range(64)}
    return sorted(back.get(p.name, p.name) for p in store.root.iterdir() if p.is_file())


def _published(store: ChunkStore) -> list[str]:
    return [name for name in _files(store) if not name.startswith(".")]


def test_miss_then_hit(tmp_path, lt) -> None:
    objects = _objects(1, 1000)
    storage, _store, dl = _make(tmp_path, lt, objects)
    data = objects["c0.bin"]
    path = dl.ensure("c0.bin", len(data), _xx(data)).result(10)
    assert _read(path) == data
    assert dl.ensure("c0.bin", len(data), _xx(data)).result(10) == path
    s = dl.stats
    assert (s.misses, s.hits, s.chunks_fetched, s.bytes) == (1, 1, 1, 1000)
    assert "hits=1" in repr(dl) and "fetched=1" in repr(dl)
    assert len(storage.reads) == 1
    dl.close()


def test_single_flight(tmp_path, lt) -> None:
    objects = _objects(1, 300_000)
    storage, _store, dl = _make(tmp_path, lt, objects)
    storage.delay_s = 0.01
    futs = [dl.ensure("c0.bin", 300_000) for _ in range(20)]
    assert len({f.result(10) for f in futs}) == 1
    assert len(storage.reads) == 1


def test_large_chunk_in_parallel_ranged_parts(tmp_path, lt) -> None:
    data = os.urandom(1_000_000)
    storage, _store, dl = _make(tmp_path, lt, {"big.bin": data}, part_bytes=256 << 10)
    path = dl.ensure("big.bin", len(data), _xx(data)).result(10)
    assert _read(path) == data
    assert sorted((s, e) for _, s, e in storage.reads) == [
        (0, 262144),
        (262144, 524288),
        (524288, 786432),
        (786432, 1_000_000),
    ]


def test_size_from_head_when_unknown(tmp_path, lt) -> None:
    objects = _objects(1, 5000)
    _, _, dl = _make(tmp_path, lt, objects)
    assert _read(dl.ensure("c0.bin").result(10)) == objects["c0.bin"]


def test_transient_error_resumes_from_received_bytes(tmp_path, lt) -> None:
    data = os.urandom(100_000)
    storage, _store, dl = _make(tmp_path, lt, {"c.bin": data})
    storage.fail_next = [TransientError("reset", retry_after=0.01)]
    storage.short = 30_000
    path = dl.ensure("c.bin", len(data), _xx(data)).result(10)
    assert _read(path) == data
    assert [(s, e) for _, s, e in storage.reads] == [(0, 100_000), (30_000, 100_000)]
    assert dl.stats.retries == 1


def test_retries_exhausted_names_url_attempts_and_cause(tmp_path, lt) -> None:
    storage, store, dl = _make(tmp_path, lt, _objects(1, 1000), retries=2)
    storage.fail_next = [TransientError(f"HTTP 503 #{i}") for i in range(10)]
    with pytest.raises(RetriesExhaustedError) as info:
        dl.ensure("c0.bin", 1000).result(10)
    msg = str(info.value)
    assert "mem://test/c0.bin" in msg and "3 attempts" in msg and "503" in msg
    assert info.value.attempts == 3 and isinstance(info.value.__cause__, TransientError)
    assert _files(store) == []


@pytest.mark.parametrize("exc", [ObjectNotFoundError("gone"), AuthError("denied")])
def test_non_transient_errors_are_not_retried(tmp_path, lt, exc) -> None:
    storage, _store, dl = _make(tmp_path, lt, _objects(1, 1000))
    storage.fail_next = [exc]
    with pytest.raises(type(exc)):
        dl.ensure("c0.bin", 1000).result(10)
    assert len(storage.reads) == 1 and dl.stats.retries == 0


def test_stall_is_a_timeout_then_retried(tmp_path, lt) -> None:
    storage, _store, dl = _make(tmp_path, lt, _objects(1, 1000), timeout_s=0.1, retries=1)
    storage.delay_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(RetriesExhaustedError) as info:
        dl.ensure("c0.bin", 1000).result(10)
    assert isinstance(info.value.__cause__, StorageTimeoutError)
    assert time.monotonic() - t0 < 2
    assert len(storage.reads) == 2


def test_checksum_mismatch_is_retried_within_the_budget_then_raised(tmp_path, lt) -> None:
    storage, store, dl = _make(tmp_path, lt, _objects(1, 1000))
    with pytest.raises(ChecksumMismatchError) as info:
        dl.ensure("c0.bin", 1000, "0" * 16).result(10)
    assert "mem://test/c0.bin" in str(info.value) and "4 downloads" in str(info.value)
    assert len(storage.reads) == 3 + 1 and _files(store) == []  # retries=3


def _local_dir(root: Path, files: dict[str, bytes]) -> DictStorage:
    """A local storage over ``root``, holding ``files`` (read in place, never fetched)."""

    class LocalDir(DictStorage):
        is_local = True

        def local_path(self, key: str) -> str:
            return str(root / key)

    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return LocalDir({})


def test_local_storage_is_read_in_place(tmp_path, lt) -> None:
    storage = _local_dir(tmp_path / "src", {"c.bin": b"abc"})
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    dl = Downloader(storage, store, _settings(tmp_path), loop_thread=lt, verify_local=True)
    assert dl.ensure("c.bin", 3, _xx(b"abc")).result(10) == str(tmp_path / "src" / "c.bin")
    with pytest.raises(ChecksumMismatchError):
        Downloader(storage, store, _settings(tmp_path), loop_thread=lt, verify_local=True).ensure(
            "c.bin", 3, "0" * 16
        ).result(10)
    with pytest.raises(ObjectNotFoundError):
        dl.ensure("missing.bin").result(10)
    assert _files(store) == [] and storage.reads == []


def test_a_local_file_replaced_under_its_name_is_verified_again(tmp_path, lt) -> None:
    dl = Downloader(
        _local_dir(tmp_path / "src", {"c.bin": b"abc"}),
        ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20),
        _settings(tmp_path),
        loop_thread=lt,
        verify_local=True,
    )
    assert dl.ensure("c.bin", 3, _xx(b"abc")).result(10) == str(tmp_path / "src" / "c.bin")
    (tmp_path / "src" / "tmp").write_bytes(b"abd")  # a rewrite: same name, same size
    os.replace(tmp_path / "src" / "tmp", tmp_path / "src" / "c.bin")
    with pytest.raises(ChecksumMismatchError):
        dl.ensure("c.bin", 3, _xx(b"abc")).result(10)


def test_hint_keeps_the_window_in_flight(tmp_path, lt) -> None:
    objects = _objects(6, 1000)
    storage, store, dl = _make(tmp_path, lt, objects, prefetch_chunks=2)
    specs = [ChunkSpec(n, 1000) for n in objects]
    dl.hint(specs)
    _wait(lambda: _published(store) == ["c0.bin", "c1.bin"])
    time.sleep(0.1)
    assert _published(store) == ["c0.bin", "c1.bin"]  # no further than the window
    assert {key for key, _, _ in storage.reads} == {"c0.bin", "c1.bin"}
    # Past the window only the files are made (the next two hinted), no byte fetched.
    _wait(lambda: store.ready_ahead() == {"c2.bin", "c3.bin"})
    dl.ensure("c0.bin", 1000).result(10)  # the reader moves on: the window slides
    _wait(lambda: store.is_cached("c2.bin"))
    assert not store.is_cached("c3.bin")


def test_new_hint_cancels_unwanted_downloads(tmp_path, lt) -> None:
    objects = _objects(4, 100_000)
    storage, store, dl = _make(tmp_path, lt, objects, prefetch_chunks=2)
    storage.delay_s = 0.5  # slow: still in flight when the hint changes
    dl.hint(["c0.bin", "c1.bin"])
    _wait(lambda: len(storage.reads) == 2)
    storage.delay_s = 0.0
    dl.hint([ChunkSpec("c2.bin", 100_000), ChunkSpec("c3.bin", 100_000)])
    _wait(lambda: store.is_cached("c2.bin") and store.is_cached("c3.bin"))
    _wait(lambda: not dl._inflight)
    assert not store.is_cached("c0.bin") and not store.is_cached("c1.bin")
    assert _files(store) == ["c2.bin", "c3.bin"]  # cancelled temps removed


def test_prefetch_dataset(tmp_path, lt) -> None:
    objects = _objects(5, 20_000)
    storage = DictStorage(objects)
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    specs = [ChunkSpec(n, len(d), _xx(d)) for n, d in objects.items()]
    stats = prefetch_dataset(storage, store, specs, _settings(tmp_path), False, loop_thread=lt)
    assert stats.chunks_fetched == 5 and stats.bytes == 100_000
    assert _files(store) == sorted(objects)
    again = prefetch_dataset(storage, store, specs, _settings(tmp_path), False, loop_thread=lt)
    assert again.hits == 5 and again.chunks_fetched == 0


def test_callers_wait_is_counted(tmp_path, lt) -> None:
    storage, _store, dl = _make(tmp_path, lt, _objects(1, 100_000))
    storage.delay_s = 0.05
    dl.ensure("c0.bin", 100_000).result(10)
    assert dl.stats.wait_s >= 0.05
    assert dl.stats.bytes_per_s > 0


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_storage_contract_type() -> None:
    assert issubclass(DictStorage, Storage)
    assert asyncio.iscoroutinefunction(Downloader.ensure_async)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_demand_just_after_its_prefetch_was_dropped_gets_the_chunk(tmp_path, lt) -> None:
    """A reader asking for a chunk whose prefetch a new hint has just cancelled (the task
    not finished yet) gets a download of its own, not the prefetch's CancelledError."""
    objects = _objects(2, 100_000)
    storage, _store, dl = _make(tmp_path, lt, objects, prefetch_chunks=1)
    storage.delay_s = 0.3
    dl.hint(["c0.bin"])
    _wait(lambda: len(storage.reads) == 1)  # c0's prefetch is in flight

    async def drop_then_demand() -> str:
        dl._set_hint([ChunkSpec("c1.bin", 100_000)])  # c0 leaves the window: cancelled
        dropped = dl._inflight["c0.bin"]
        assert dropped.cancelling() and not dropped.done()
        path = await dl.ensure_async("c0.bin", 100_000)
        assert dropped.cancelled()  # the fault fired: the first download did end cancelled
        return path

    path = lt.call(drop_then_demand(), 10)
    assert _read(path) == objects["c0.bin"]


class _Traced(DictStorage):
    """Records when each ranged read starts and sends its last piece; one read, ``hold``
    (key, start), sends its last piece only once ``release`` is set."""

    def __init__(self, objects: dict[str, bytes], hold: tuple[str, int]) -> None:
        super().__init__(objects)
        self.hold = hold
        self.release = threading.Event()
        self.events: list[tuple[str, str, int]] = []

    async def _iter_range_impl(self, key: str, start: int, end: int | None):  # type: ignore[override]
        self.events.append(("start", key, start))
        data = self.objects[key][start:end]
        for i in range(0, len(data), self.piece):
            await asyncio.sleep(0.001)  # parts in flight take turns, as on a link
            if i + self.piece >= len(data):
                if (key, start) == self.hold:
                    await asyncio.to_thread(self.release.wait, 20)  # bounded
                self.events.append(("end", key, start))
            yield data[i : i + self.piece]


def test_the_window_starts_a_chunk_when_its_parts_fit_beside_those_in_flight(tmp_path, lt) -> None:
    """Chunks of 4 parts, 8 connections, 4 chunks hinted: the next chunk starts when a
    part lands and none of the earlier chunks' parts queues for a slot, its own parts
    taking slots only after theirs, so chunks land in the order they are read. Before,
    every chunk of the window started at once, each slot a part freed went to a later
    chunk, and the chunks landed together (docs/performance.md, "Where a cold epoch's
    time went")."""
    size, part = 4 << 20, 1 << 20
    objects = _objects(4, size)
    storage = _Traced(objects, hold=("c0.bin", 3 * part))  # c0's last part lands last
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 30)
    settings = _settings(tmp_path, part_bytes=part, max_concurrency=8, prefetch_chunks=4)
    dl = Downloader(storage, store, settings, loop_thread=lt)
    dl.hint([ChunkSpec(n, size) for n in objects])
    try:
        _wait(lambda: store.is_cached("c3.bin"))  # c1, then c2, then c3, c0 still held
        starts = {
            k: i for i, (what, k, s) in reversed(list(enumerate(storage.events))) if what == "start"
        }
        last_start = {k: i for i, (what, k, s) in enumerate(storage.events) if what == "start"}
        last_end = {k: i for i, (what, k, s) in enumerate(storage.events) if what == "end"}
        assert starts["c0.bin"] < starts["c2.bin"] and starts["c1.bin"] < starts["c2.bin"]
        assert starts["c2.bin"] > last_start["c1.bin"], "c2 took a slot before c1's last part"
        assert starts["c3.bin"] > last_start["c2.bin"], "c3 took a slot before c2's last part"
        assert last_end["c1.bin"] < last_end["c2.bin"] < last_end["c3.bin"], "out of order"
        assert not store.is_cached("c0.bin") and dl.in_flight("c0.bin")  # the hold fired
    finally:
        storage.release.set()
    _wait(lambda: store.is_cached("c0.bin"))
    for name, data in objects.items():
        assert _read(str(store.path(name))) == data


def test_files_made_ahead_are_used_and_released_with_the_hint(tmp_path, lt) -> None:
    objects = _objects(6, 1000)
    storage, store, dl = _make(tmp_path, lt, objects, prefetch_chunks=1)
    specs = [ChunkSpec(n, 1000, _xx(d)) for n, d in objects.items()]
    dl.hint(specs)
    _wait(lambda: store.is_cached("c0.bin") and store.ready_ahead() == {"c1.bin", "c2.bin"})
    made = {p.name for p in store.root.iterdir() if p.name.startswith(".c1.bin.")}
    storage.delay_s = 0.2  # c1 is still downloading when the files are looked at
    dl.ensure("c0.bin", 1000).result(10)  # the reader moves on: c1 starts, in its file
    _wait(lambda: dl.in_flight("c1.bin") and "c1.bin" not in store.ready_ahead())
    # Taken by the download, which writes into it: the only file of c1.
    assert {p.name for p in store.root.iterdir() if p.name.startswith(".c1.bin.")} == made
    storage.delay_s = 0.0
    dl.ensure("c1.bin", 1000).result(10)
    assert store.path("c1.bin").read_bytes() == objects["c1.bin"]
    _wait(lambda: store.ready_ahead() == {"c3.bin", "c4.bin"})  # c2 is the window now
    dl.hint(specs[5:])  # the hint moves past c3 and c4: their files go, never fetched
    _wait(lambda: store.is_cached("c5.bin") and not store.ready_ahead())
    _wait(lambda: not [p for p in store.root.iterdir() if p.name.startswith((".c3", ".c4"))])
    assert not {"c3.bin", "c4.bin"} & {key for key, _, _ in storage.reads}
    dl.close()
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("hand_over", [False, True])
def test_a_waiting_reader_finds_its_chunk_pinned_however_late_it_wakes(
    tmp_path, lt, hand_over
) -> None:
    """A reader's thread may wake long after the I/O thread answered it, and the chunk's
    publish let go of it meanwhile: another process's evictor can take it before the
    reader pins it (without ``hand_over``: shown). Handed over, it is pinned for the reader
    as the answer goes out; the reader's pin takes it over."""
    objects = _objects(1, 1000)
    _storage, store, dl = _make(tmp_path, lt, objects)
    other = ChunkStore(tmp_path / "ds", max_cache_bytes=1000)  # another process's evictor
    data = objects["c0.bin"]
    for attempt in range(2):  # a download, then a hit
        fut = dl.ensure("c0.bin", len(data), _xx(data), early=True, hand_over=hand_over)
        fut.result(10)
        assert dl.wait_published(10)
        deadline = time.monotonic() + 10
        while store.pinned().get("c0.bin", 0) != int(hand_over):
            assert time.monotonic() < deadline, store.pinned()  # the publisher's pin lets go
            time.sleep(0.01)
        removed = asyncio.run(other.make_room(1000))  # the reader's thread has not run yet
        path = store.pin("c0.bin")
        if not hand_over:
            assert removed == 1000 and path is None, "evicted before the reader's pin"
            return
        assert removed == 0 and path is not None and _read(path) == data
        assert store.pinned() == {"c0.bin": 1}, "the reader's pin took the hand-over"
        store.unpin("c0.bin")
        assert store.pinned() == {}
        assert dl.stats.chunks_fetched == 1 and dl.stats.hits == attempt


def _counting_is_cached(store: ChunkStore) -> list[str]:
    """Record every name ``store.is_cached`` is asked about from now on."""
    asked: list[str] = []
    real = store.is_cached

    def is_cached(name: str, size: int | None = None) -> bool:
        asked.append(name)
        return real(name, size)

    store.is_cached = is_cached  # type: ignore[method-assign]
    return asked


def test_prefetch_looks_at_a_published_chunk_once_while_the_hint_names_it(tmp_path, lt) -> None:
    """The prefetch decisions ask about every chunk of the window at every landing and
    every read; a chunk found published is not looked at again (a stat and a stamp read
    each). Only the reader's own asks look at the file."""
    objects = _objects(8, 1000)
    storage, store, dl = _make(tmp_path, lt, objects, prefetch_chunks=8, max_concurrency=8)
    specs = [ChunkSpec(n, 1000, _xx(d)) for n, d in objects.items()]
    dl.hint(specs)
    _wait(lambda: all(store.is_cached(n) for n in objects) and not dl._inflight)
    dl.hint(specs)  # (the same hint again: every chunk published, each looked at once)
    asked = _counting_is_cached(store)
    for name, data in objects.items():
        assert _read(dl.ensure(name, 1000, _xx(data)).result(10)) == data
    # One ask per read; before, every read's prefetch pass asked about each chunk of
    # the window left: 8 + 7 + ... + 1 more.
    assert sorted(asked) == sorted(objects), asked
    assert len(storage.reads) == 8  # nothing fetched twice


def test_a_chunk_removed_after_the_prefetch_saw_it_is_fetched_for_its_reader(tmp_path, lt) -> None:
    """What the prefetch remembers as published is never what a reader gets: a chunk
    removed underneath (another process's evictor) is fetched again when read."""
    objects = _objects(3, 1000)
    storage, store, dl = _make(tmp_path, lt, objects, prefetch_chunks=3)
    specs = [ChunkSpec(n, 1000, _xx(d)) for n, d in objects.items()]
    dl.hint(specs)
    _wait(lambda: all(store.is_cached(n) for n in objects) and not dl._inflight)
    assert "c2.bin" in dl._seen_cached  # the prefetch saw it
    os.unlink(store.path("c2.bin"))  # removed underneath
    for name, data in objects.items():
        assert _read(dl.ensure(name, 1000, _xx(data)).result(10)) == data
    assert [key for key, _, _ in storage.reads].count("c2.bin") == 2  # fetched again
    assert "c2.bin" not in dl._seen_cached


def test_wait_published_gives_up_on_a_closed_io_thread_but_lets_a_bug_through(
    tmp_path, monkeypatch
) -> None:
    """A closed I/O thread publishes nothing more: ``wait_published`` says False. An error
    of the wait's own code is not that, and reaches the caller instead of reading as
    "gave up" (a renamed method once failed there unseen)."""
    lt = LoopThread()
    _storage, _store, dl = _make(tmp_path, lt, _objects(1, 10))

    async def pending() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(asyncio.sleep(60))

    task = lt.call(pending(), 10)
    dl._publishing.add(task)  # a publish under way that never ends
    assert dl.wait_published(0.05) is False  # bounded, and the publish is still under way

    async def broken(timeout: float) -> bool:
        raise TypeError("a bug in the wait")

    monkeypatch.setattr(dl, "_published", broken)
    with pytest.raises(TypeError, match="a bug in the wait"):
        dl.wait_published(1)
    monkeypatch.undo()
    lt.close()
    assert dl.wait_published(1) is False  # closed: BridgeError, read as "gave up"
