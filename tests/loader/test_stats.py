"""loader.stats: download counters summed over the workers, cache occupancy, stall."""

from __future__ import annotations

import os

from asynccache import CacheDataLoader, Fetcher, Settings, StreamingDataset
from asynccache.write.upload import upload
from tests.loader.datasets import DictDataset

N = 40


def test_stats_sum_every_worker_and_add_the_fetchers_stall(objstore, bucket, tmp_path):
    src = tmp_path / "src"
    list(CacheDataLoader(DictDataset(N), cache_dir=src, chunk_size=4, batch_size=8))
    url = f"s3://{bucket}/ds"
    upload(src, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    ds = StreamingDataset(
        url,
        cache_dir=tmp_path / "c",
        storage_options=objstore.storage_options,
        max_cache_bytes="64MiB",  # far below the disk: the budget is the setting, not the disk
    )
    chunks = len(ds.index.chunks)
    dl = CacheDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    assert dl.stats.chunks_fetched == 0
    list(dl)
    first = dl.stats
    assert ds.source.stats.chunks_fetched == 0, "the main process downloaded nothing itself"
    assert first.chunks_fetched + first.hits >= chunks and first.chunks_fetched >= chunks
    on_disk = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(tmp_path / "c")
        for f in files
        if f.startswith("chunk-")
    )
    assert first.bytes == on_disk and first.cached_bytes == on_disk
    assert first.cache_budget == ds.settings.max_cache_bytes == 64 << 20
    with Fetcher(dl, prefetch_batches=2) as fetcher:  # new worker processes: all hits
        assert sum(1 for _ in fetcher) == N // 4
        second = dl.stats.with_stall(fetcher.stats)
    assert second.chunks_fetched == first.chunks_fetched, "the earlier workers' counts stay"
    assert second.hits >= first.hits + chunks
    assert second.stall is not None and second.stall.steps == N // 4
    assert "stall_pct=" in str(second) and f"fetched={first.chunks_fetched}" in str(second)
