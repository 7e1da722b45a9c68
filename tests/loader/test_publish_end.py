"""A worker's epoch ends once the chunks it read are published.

A worker reads a chunk it downloaded as soon as the chunk is verified, while its fsync
and rename go on; its process exit waits for them, but torch terminates a worker that
has not exited a few seconds after the epoch's end, and a chunk whose fsync ran past
that was lost to the cache (downloaded and counted, never published).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
import uuid

import pytest
import torch.utils.data._utils as torch_data_utils

import asynccache.download.downloader as downloader
from asynccache import CacheDataLoader, Settings, StreamingDataset
from asynccache.read.source import DatasetSource
from asynccache.write.upload import upload
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


@pytest.fixture(scope="module")
def uploaded(objstore, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The URL of a small dataset of several chunks (deleted after the module)."""
    src = tmp_path_factory.mktemp("src")
    list(CacheDataLoader(DictDataset(N), cache_dir=src, chunk_size=4, batch_size=8))
    name = f"t-{uuid.uuid4().hex[:16]}"
    objstore.create_bucket(name)
    url = f"s3://{name}/ds"
    upload(src, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    yield url
    with contextlib.suppress(Exception):
        objstore.delete_bucket(name)


def _epoch(url, objstore, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """One epoch of two workers whose every publish is slow, torch waiting only briefly
    for them to exit: the loader, its dataset, the chunk names and those published."""
    cache = tmp_path / "c"
    ds = StreamingDataset(
        url,
        cache_dir=cache,
        storage_options=objstore.storage_options,
        settings=Settings.from_env(progress=False, durable=True, fsync_publish=True),
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
    assert sum(1 for _ in dl) == N // 4
    assert sorted(marks.read_text().split()) == names, "every chunk's publish was slowed"
    return dl, names, _published(cache)


def _published(cache):  # type: ignore[no-untyped-def]
    return sorted(
        f
        for _, _, files in os.walk(cache)
        for f in files
        if f.startswith("chunk-") and f.endswith(".bin")
    )


def test_every_chunk_read_in_an_epoch_is_published_when_it_ends(
    uploaded, objstore, tmp_path, monkeypatch, capfd
):
    dl, names, published = _epoch(uploaded, objstore, tmp_path, monkeypatch)
    assert published == names, "a chunk read in the epoch is missing from the cache"
    assert "chunk publishes still running" not in capfd.readouterr().err
    stats = dl.stats
    assert stats.chunks_fetched == len(names)
    cache = tmp_path / "c"
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


def test_publishes_left_past_the_bound_are_reported(
    uploaded, objstore, tmp_path, monkeypatch, capfd
):
    """When the wait at the end of a worker's iteration gives up (``timeout_s``), the
    worker says so: torch may then end it (with exit status 0) before those publishes
    finish, and their chunks are lost to the cache, as here."""
    monkeypatch.setattr(DatasetSource, "wait_published", lambda self: False)  # gave up
    handler = logging.StreamHandler(sys.stderr)  # (the workers inherit it)
    logging.getLogger("asynccache").addHandler(handler)
    try:
        _, names, published = _epoch(uploaded, objstore, tmp_path, monkeypatch)
    finally:
        logging.getLogger("asynccache").removeHandler(handler)
    assert published != names, "the race did not happen: the test proves nothing"
    err = capfd.readouterr().err
    assert "chunk publishes still running" in err and "will be downloaded again" in err
