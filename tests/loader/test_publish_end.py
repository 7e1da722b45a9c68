"""A worker's epoch ends once the chunks it read are published.

A worker reads a chunk it downloaded as soon as the chunk is verified, while its fsync
and rename go on; its process exit waits for them, but torch terminates a worker that
has not exited a few seconds after the epoch's end, and a chunk whose fsync ran past
that was lost to the cache (downloaded and counted, never published).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch.utils.data._utils as torch_data_utils

import asynccache.download.downloader as downloader
from asynccache import CacheDataLoader, Settings, StreamingDataset
from asynccache.upload import upload
from tests.loader.datasets import DictDataset

N = 24
SLOW_PUBLISH_S = 0.6  # an fsync under heavy write load: longer than torch waits below


def _slow_publishes(marks: str, _worker_id: int) -> None:
    """In each worker: every publish notes the chunk, then stalls before its fsync."""
    publish = downloader._publish_adopted

    def slow(tmp, store, name):  # type: ignore[no-untyped-def]
        with open(marks, "a") as f:
            f.write(f"{name}\n")
        time.sleep(SLOW_PUBLISH_S)
        publish(tmp, store, name)

    downloader._publish_adopted = slow


def test_every_chunk_read_in_an_epoch_is_published_when_it_ends(
    objstore, bucket, tmp_path, monkeypatch, caplog
):
    src = tmp_path / "src"
    list(CacheDataLoader(DictDataset(N), cache_dir=src, chunk_size=4, batch_size=8))
    url = f"s3://{bucket}/ds"
    upload(src, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    cache = tmp_path / "c"
    ds = StreamingDataset(
        url,
        cache_dir=cache,
        storage_options=objstore.storage_options,
        settings=Settings.from_env(progress=False, durable=True),
    )
    names = sorted(c.filename for c in ds.index.chunks)
    marks = tmp_path / "publishes"
    # How long torch waits for a worker to exit after the epoch before terminating it
    # (5 s), shortened so that a publish still running at the end is cut every time.
    monkeypatch.setattr(torch_data_utils, "MP_STATUS_CHECK_INTERVAL", 0.05)
    dl = CacheDataLoader(
        ds,
        batch_size=4,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=functools.partial(_slow_publishes, str(marks)),
    )
    with caplog.at_level(logging.WARNING, logger="asynccache"):
        assert sum(1 for _ in dl) == N // 4
    assert sorted(marks.read_text().split()) == names, "every chunk's publish was slowed"
    published = sorted(
        f
        for _, _, files in os.walk(cache)
        for f in files
        if f.startswith("chunk-") and f.endswith(".bin")
    )
    assert published == names, "a chunk read in the epoch is missing from the cache"
    assert not [r for r in caplog.records if "ended by signal" in r.getMessage()]
    stats = dl.stats
    assert stats.chunks_fetched == len(names)
    on_disk = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(cache)
        for f in fs
        if f.startswith("chunk-") and f.endswith(".bin")
    )
    assert stats.bytes == on_disk
    # The next epoch's new workers find every chunk in the cache.
    assert sum(1 for _ in dl) == N // 4
    assert dl.stats.chunks_fetched == len(names)
