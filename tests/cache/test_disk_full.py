"""A full disk evicts before it fails (issue 9, point 5), on a real 8 MiB tmpfs."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import xxhash
from small_fs import on_small_fs

from asynccache.cache import ChunkStore, dataset_dir
from asynccache.errors import DiskFullError
from asynccache.storage.base import ObjectInfo, Storage

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
OLD = 1_000_000.0


def _publish(store: ChunkStore, name: str, size: int, mtime: float | None = None) -> None:
    tmp = store.create_temp(name, size)  # placed directly: no reservation, no eviction
    tmp.pwrite(b"x" * size, 0)
    tmp.publish()
    if mtime is not None:
        os.utime(store.path(name), (mtime, mtime))


def _reserve_and_publish(store: ChunkStore, name: str, size: int) -> None:
    tmp = asyncio.run(store.reserve(name, size))
    tmp.pwrite(b"y" * size, 0)
    tmp.publish()


def evicts_older_chunks_to_fit(mnt: Path) -> None:
    cache = mnt / "cache"
    old = ChunkStore(dataset_dir(cache, "s3://b/ds", "v0"), max_cache_bytes=1 << 40)
    store = ChunkStore(dataset_dir(cache, "s3://b/ds", "v1"), max_cache_bytes=1 << 40)
    for i in range(3):
        _publish(old, f"chunk-0-{i}.bin", MiB, OLD + i)
    for i in range(4):
        _publish(store, f"chunk-0-{i}.bin", MiB, OLD + 10 + i)
    for i in range(4, 8):  # the disk holds about 7 such chunks: older ones must go
        _reserve_and_publish(store, f"chunk-0-{i}.bin", MiB)
    assert not any(old.is_cached(f"chunk-0-{i}.bin") for i in range(3))
    assert all(store.is_cached(f"chunk-0-{i}.bin", MiB) for i in range(4, 8))
    assert store.used_bytes() <= 8 * MiB
    assert store.evicted >= 4


def pinned_chunks_fill_the_disk(mnt: Path) -> None:
    store = ChunkStore(dataset_dir(mnt / "cache", "s3://b/ds", "v1"), max_cache_bytes=1 << 40)
    for i in range(7):
        _publish(store, f"chunk-0-{i}.bin", MiB, OLD + i)
        assert store.pin(f"chunk-0-{i}.bin")
    # A file made ahead of its download is not made (nothing is evicted for it), and
    # leaves the error to the download's own reservation, which says the same as before.
    assert not asyncio.run(store.reserve_ahead("chunk-0-9.bin", MiB))
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(DiskFullError) as info:
        asyncio.run(store.reserve("chunk-0-9.bin", MiB))
    assert str(store.root) in str(info.value)
    assert all(store.is_cached(f"chunk-0-{i}.bin") for i in range(7))
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]
    store.close()


def a_foreign_file_fills_the_disk(mnt: Path) -> None:
    cache = mnt / "cache"
    store = ChunkStore(dataset_dir(cache, "s3://b/ds", "v1"), max_cache_bytes=1 << 40)
    foreign = cache / "checkpoints" / "model.pt"
    foreign.parent.mkdir()
    with open(foreign, "wb") as f:
        f.write(b"u" * (7 * MiB + MiB // 2))
    with pytest.raises(DiskFullError) as info:
        asyncio.run(store.reserve("chunk-0-0.bin", MiB))
    assert str(store.root) in str(info.value)
    assert foreign.stat().st_size == 7 * MiB + MiB // 2


def _fill_disk(path: Path) -> None:
    st = os.statvfs(path.parent)
    with open(path, "wb") as f:
        f.write(b"z" * (st.f_bavail * st.f_frsize - MiB // 2))
    os.utime(path, (OLD, OLD))


class _FillingStorage(Storage):
    """Serves one chunk; on the first GET another writer fills the disk with an old chunk."""

    def __init__(self, data: bytes, filler: Path) -> None:
        self.url = "mem://fill"
        self.data = data
        self.filler: Path | None = filler

    async def _head_impl(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, len(self.data))

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        if self.filler is not None:  # a peer publishes a chunk that takes the space left
            await asyncio.to_thread(_fill_disk, self.filler)
            self.filler = None
        data = self.data[start:end]
        for i in range(0, len(data), 1 << 16):
            yield data[i : i + (1 << 16)]

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        raise NotImplementedError

    async def _upload_impl(self, src: str, key: str) -> int:
        raise NotImplementedError

    async def _delete_impl(self, key: str) -> None:
        raise NotImplementedError


def download_evicts_and_retries_when_pwrite_finds_the_disk_full(mnt: Path) -> None:
    from asynccache.bridge import LoopThread
    from asynccache.config import Settings
    from asynccache.download.downloader import Downloader

    # A filesystem whose preallocation does not reserve blocks (copy-on-write ones):
    # the space runs out in pwrite, mid-download.
    real_fallocate = os.posix_fallocate
    os.posix_fallocate = lambda fd, offset, length: None
    try:
        settings = Settings(cache_dir=str(mnt / "cache"), max_cache_bytes=1 << 40, retries=1)
        store = ChunkStore.for_dataset(settings, "mem://fill", "v1")
        data = os.urandom(2 * MiB)
        storage = _FillingStorage(data, store.path("chunk-9-9.bin"))
        lt = LoopThread()
        dl = Downloader(storage, store, settings, loop_thread=lt)
        try:
            checksum = xxhash.xxh3_64(data).hexdigest()
            path = dl.ensure("chunk-0-0.bin", len(data), checksum).result(60)
            with open(path, "rb") as f:
                assert f.read() == data
            assert not store.is_cached("chunk-9-9.bin")  # the older chunk was evicted
        finally:
            dl.close()
            lt.close()
    finally:
        os.posix_fallocate = real_fallocate


def test_a_full_disk_evicts_older_chunks(tmp_path) -> None:
    on_small_fs(evicts_older_chunks_to_fit, tmp_path)


def test_pinned_chunks_filling_the_disk_raise_disk_full(tmp_path) -> None:
    on_small_fs(pinned_chunks_fill_the_disk, tmp_path)


def test_a_foreign_file_filling_the_disk_raises_disk_full(tmp_path) -> None:
    on_small_fs(a_foreign_file_fills_the_disk, tmp_path)


def test_download_evicts_and_retries_when_the_disk_fills_mid_write(tmp_path) -> None:
    on_small_fs(download_evicts_and_retries_when_pwrite_finds_the_disk_full, tmp_path)
