"""A cache directory deleted under a live store is rebuilt (issue 9, point 6)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import xxhash

from asynccache.cache import ChunkStore, dataset_dir

pytestmark = pytest.mark.timeout(60)


def _publish(store: ChunkStore, name: str, size: int) -> None:
    tmp = asyncio.run(store.reserve(name, size))
    tmp.pwrite(b"x" * size, 0)
    tmp.publish()


@pytest.mark.parametrize("what", ["dataset", "cache"])
def test_store_rebuilds_a_deleted_layout(tmp_path, what) -> None:
    cache = tmp_path / "cache"
    store = ChunkStore(dataset_dir(cache, "s3://b/ds", "v1"), max_cache_bytes=1 << 20)
    _publish(store, "chunk-0-0.bin", 100)
    shutil.rmtree(store.root if what == "dataset" else cache)

    assert not store.is_cached("chunk-0-0.bin") and store.pin("chunk-0-0.bin") is None

    async def download_again() -> None:
        async with store.download_lock("chunk-0-0.bin"):
            tmp = await store.reserve("chunk-0-0.bin", 100)
            tmp.pwrite(b"y" * 100, 0)
            tmp.publish()

    asyncio.run(download_again())
    assert store.path("chunk-0-0.bin").read_bytes() == b"y" * 100
    assert (store.root / ".locks" / ".asynccache-dataset").is_file()

    shutil.rmtree(cache)
    tmp = store.create_temp("chunk-0-1.bin", 10)  # a temporary file alone rebuilds too
    tmp.discard()
    shutil.rmtree(cache)
    assert asyncio.run(store.make_room(10)) == 0
    assert store.pin("chunk-0-0.bin") is None


def test_downloader_downloads_again_after_rm_rf(tmp_path, http_origin) -> None:
    from asynccache.bridge import LoopThread
    from asynccache.config import Settings
    from asynccache.download.downloader import Downloader
    from asynccache.storage.http import HttpStorage

    src = tmp_path / "src"
    src.mkdir()
    data = b"chunk bytes " * 1000
    (src / "chunk-0-0.bin").write_bytes(data)
    server = http_origin(src)
    cache = tmp_path / "cache"
    settings = Settings(cache_dir=str(cache), max_cache_bytes=1 << 20, retries=1)
    store = ChunkStore.for_dataset(settings, server.url, "v1")
    lt = LoopThread()
    storage = HttpStorage(server.url, settings)
    dl = Downloader(storage, store, settings, loop_thread=lt)
    try:
        checksum = xxhash.xxh3_64(data).hexdigest()
        first = dl.ensure("chunk-0-0.bin", len(data), checksum).result(30)
        shutil.rmtree(cache)
        again = dl.ensure("chunk-0-0.bin", len(data), checksum).result(30)
        assert again == first
        with open(again, "rb") as f:
            assert f.read() == data
        assert dl.stats.chunks_fetched == 2
    finally:
        dl.close()
        lt.call(storage.close(), 10)
        lt.close()
