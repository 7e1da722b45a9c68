"""A chunk is read by the process that downloaded it before its publish (the fsync) ends;
nothing else sees it before then, and a publish that fails leaves nothing behind.

Real HTTP origin, real downloader, cache and reader; the publish is held (or its fsync
made to fail) in this process only.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import early_support
import numpy as np
import pytest

from asynccache.cache import ChunkStore
from asynccache.cache.layout import TempFile, is_temp_name, reopens, shown_path, sweep_orphans
from asynccache.config import Settings
from asynccache.read.reader import Reader
from asynccache.read.source import DatasetSource
from tests.helpers import noise_item, write_noise_dataset

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd"),
]

_GATE_S = 10.0  # a held publish goes on after this (today's code then fails the test)
_WAIT_S = 30.0
ITEM = 4096


class _Gate:
    """Holds every TempFile.publish of this process until opened (bounded)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        real = TempFile.publish

        def publish(tmp: TempFile) -> None:
            self.entered.set()
            self.open.wait(_GATE_S)
            real(tmp)

        monkeypatch.setattr(TempFile, "publish", publish)


def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _settings(tmp_path: Path, **kw) -> Settings:
    base = dict(
        cache_dir=str(tmp_path / "cache"),
        retries=2,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        timeout_s=10.0,
        prefetch_chunks=0,
        durable=True,
        fsync_publish=True,  # read before the publish ends: only a publish that fsyncs
    )
    base.update(kw)
    return Settings(**base)


@pytest.fixture
def url(tmp_path, http_origin) -> str:
    return http_origin(write_noise_dataset(tmp_path / "src", 32, 16, ITEM)).url


def _temps(store: ChunkStore) -> list[str]:
    return [p.name for p in store.root.iterdir() if is_temp_name(p.name)]


def _same_item(got, i: int) -> None:
    want = noise_item(i, ITEM)
    assert got["i"] == want["i"] and np.array_equal(got["x"], want["x"])


def test_a_reader_maps_its_chunk_before_the_publish(tmp_path, url, monkeypatch) -> None:
    with DatasetSource(url, settings=_settings(tmp_path)) as src:
        gate = _Gate(monkeypatch)  # the index is in: chunks only from here
        reader = Reader(src.index, src.acquire, release=src.release, ranged=None)
        _same_item(reader.read(0, 3), 3)  # answered while the publish is held
        store = src.store
        assert store is not None
        name = src.index.filename(0)
        final = store.path(name)
        assert gate.entered.wait(_WAIT_S) and not gate.open.is_set()  # the publish runs
        assert not final.exists()  # read before the final name existed
        assert src.landed(0)
        [temp] = _temps(store)
        assert sweep_orphans(store.root) == []  # the publishing file is alive
        assert _temps(store) == [temp]
        path = src.acquire(0)
        assert reopens(path) and shown_path(path) == str(final)  # messages name the chunk
        src.release(0)
        gate.open.set()
        _until(lambda: not src.downloader().in_flight(name), "the publish never ended")
        assert final.exists() and _temps(store) == []
        assert src.acquire(0) == str(final)  # published: pinned by its own name now
        src.release(0)
        _same_item(reader.read(0, 5), 5)
        reader.close()
        assert store.pinned() == {}
        assert src.stats.chunks_fetched == 1


def test_a_failed_publish_leaves_nothing_and_the_next_read_fetches_again(
    tmp_path, url, monkeypatch
) -> None:
    failed: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if not failed and is_temp_name(os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))):
            failed.append(fd)
            raise OSError(errno.EIO, "injected I/O error")
        real_fsync(fd)

    with DatasetSource(url, settings=_settings(tmp_path)) as src:
        gate = _Gate(monkeypatch)  # the index is in: chunks only from here
        monkeypatch.setattr(os, "fsync", fsync)
        reader = Reader(src.index, src.acquire, release=src.release, ranged=None)
        _same_item(reader.read(0, 1), 1)
        store = src.store
        assert store is not None
        name = src.index.filename(0)
        gate.open.set()
        _until(lambda: not src.downloader().in_flight(name), "the publish never ended")
        assert failed  # the fault fired
        assert not store.path(name).exists() and _temps(store) == []
        assert store.pinned() == {name: 1}  # the reader's pin alone: the publisher's is gone
        _same_item(reader.read(0, 2), 2)  # the verified bytes it mapped stay readable
        reader.close()
        assert store.pinned() == {}
        assert src.stats.chunks_fetched == 1  # fetched and served, not published
        _same_item(reader.read(0, 7), 7)  # fetched again, published this time
        reader.close()
        _until(lambda: not src.downloader().in_flight(name), "the publish never ended")
        assert store.path(name).exists() and store.pinned() == {}
        assert src.stats.chunks_fetched == 2


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_child_never_holds_the_adopted_descriptor(tmp_path, url, monkeypatch, method) -> None:
    with DatasetSource(url, settings=_settings(tmp_path)) as src:
        gate = _Gate(monkeypatch)  # the index is in: chunks only from here
        path = src.acquire(0)
        try:
            assert reopens(path) and not gate.open.is_set()
            fd = int(os.path.basename(path))
            ino = os.stat(path).st_ino
            assert os.fstat(fd).st_ino == ino  # held here
            proc = multiprocessing.get_context(method).Process(
                target=early_support.holds, args=(fd, ino)
            )
            proc.start()
            proc.join(_WAIT_S)
            assert proc.exitcode == 0, "the child holds the adopted descriptor"
        finally:
            src.release(0)
            gate.open.set()
        _until(lambda: not src.downloader().in_flight(src.index.filename(0)), "no publish")


def _blocked_on(ino: int, pid: int) -> bool:
    """``pid`` waits for a flock on inode ``ino`` (``/proc/locks``: "->" lines)."""
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields and str(pid) in fields and any(x.endswith(f":{ino}") for x in fields):
                return True
    return False


def test_another_process_gets_the_chunk_only_once_published(tmp_path, url, monkeypatch) -> None:
    settings = _settings(tmp_path)
    with DatasetSource(url, settings=settings) as src:
        gate = _Gate(monkeypatch)  # the index is in: chunks only from here
        path = src.acquire(0)
        try:
            assert reopens(path)
            store = src.store
            assert store is not None
            name = src.index.filename(0)
            ctx = multiprocessing.get_context("fork")
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=early_support.acquire_first, args=(url, settings, theirs))
            proc.start()
            try:
                lock_ino = os.stat(store.lock_path(name)).st_ino
                _until(lambda: _blocked_on(lock_ino, proc.pid), "the other never waited")
                assert not mine.poll()  # still waiting: the download lock is held
                gate.open.set()
                assert mine.poll(_WAIT_S)
                got, existed, data, fetched = mine.recv()
            finally:
                proc.join(_WAIT_S)
            assert got == str(store.path(name)) and existed  # the published name
            assert fetched == 0  # it found it published, fetched nothing
            with open(path, "rb") as f:
                assert data == f.read()
        finally:
            src.release(0)
            gate.open.set()


def test_batches_are_bit_identical_durable_or_not(tmp_path, url, monkeypatch) -> None:
    # Durable, every publish is held while the epoch runs: its batches are assembled
    # from chunks reached through the downloader's descriptors only.
    import torch

    from asynccache import CacheDataLoader, StreamingDataset

    got = []
    for durable in (True, False):
        settings = _settings(tmp_path / str(durable), durable=durable)
        ds = StreamingDataset(url, settings=settings, batch_size=8)
        gate = _Gate(monkeypatch) if durable else None
        try:
            got.append(list(CacheDataLoader(ds, batch_size=8, num_workers=0)))
            if gate is not None:
                store = ds.source.store
                assert store is not None and not any(store.path(n).exists() for n in store.pinned())
                assert len(store.pinned()) == 2  # both chunks adopted, neither published
        finally:
            if gate is not None:
                gate.open.set()
                monkeypatch.undo()
        ds.source.close()
    assert len(got[0]) == len(got[1]) == 4
    for a, b in zip(*got, strict=True):
        assert torch.equal(a["i"], b["i"])
        assert torch.equal(a["x"], b["x"])
