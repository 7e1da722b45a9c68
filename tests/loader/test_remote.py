"""Cache and CacheDataLoader reading a dataset from S3 (SeaweedFS) and HTTP."""

from __future__ import annotations

import os

import pytest
import torch

from asynccache import Cache, CacheDataLoader, ConfigError, ObjectNotFoundError
from asynccache.config import Settings
from asynccache.write.upload import upload
from tests.helpers import assert_same
from tests.loader.datasets import DictDataset


@pytest.fixture
def written(tmp_path):
    src = tmp_path / "src"
    list(CacheDataLoader(DictDataset(41), cache_dir=src, chunk_size=6, batch_size=8, num_workers=2))
    return src


def _quiet() -> Settings:
    return Settings.from_env(progress=False)


def test_cache_reads_every_item_from_s3(written, objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    upload(written, url, objstore.storage_options, settings=_quiet())
    cache = Cache(url, cache_dir=tmp_path / "cc", storage_options=objstore.storage_options)
    assert cache.filled and len(cache) == 41
    ds = DictDataset(41)
    for i in reversed(range(41)):
        assert_same(ds[i], cache[i])
    fetched = cache.source.stats
    assert fetched.chunks_fetched == len(cache.index.chunks)  # each chunk exactly once
    cache.source.close()  # the last chunk read may still be publishing: close waits for it
    cached = [
        f
        for d in os.listdir(tmp_path / "cc")
        if os.path.isdir(tmp_path / "cc" / d)
        for f in os.listdir(tmp_path / "cc" / d)
        if f.endswith(".bin")
    ]
    assert sorted(cached) == sorted(c.filename for c in cache.index.chunks)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_reads_from_s3_with_workers(written, objstore, bucket, tmp_path, num_workers):
    url = f"s3://{bucket}/ds"
    upload(written, url, objstore.storage_options, settings=_quiet())
    cache = Cache(url, cache_dir=tmp_path / "cc", storage_options=objstore.storage_options)
    dl = CacheDataLoader(cache, batch_size=8, num_workers=num_workers, shuffle=True, seed=3)
    got = torch.cat([b["i"] for b in dl])
    assert sorted(got.tolist()) == list(range(41))


def test_cache_reads_from_http(written, http_origin, tmp_path):
    server = http_origin(written)
    cache = Cache(server.url, cache_dir=tmp_path / "cc")
    ds = DictDataset(41)
    for i in range(41):
        assert_same(ds[i], cache[i])


def test_missing_remote_dataset_is_not_filled(objstore, bucket, tmp_path):
    cache = Cache(
        f"s3://{bucket}/nothing", cache_dir=tmp_path, storage_options=objstore.storage_options
    )
    assert not cache.filled
    with pytest.raises(ObjectNotFoundError, match="nothing/index.json"):
        cache[0]


def test_remote_cache_is_read_only(objstore, bucket, tmp_path):
    cache = Cache(f"s3://{bucket}/x", cache_dir=tmp_path, storage_options=objstore.storage_options)
    with pytest.raises(ConfigError, match="upload"):
        cache[0] = 1


def test_prefetch_warms_the_cache_then_only_hits(written, objstore, bucket, tmp_path):
    from asynccache import prefetch

    url = f"s3://{bucket}/ds"
    upload(written, url, objstore.storage_options, settings=_quiet())
    first = prefetch(url, tmp_path / "cc", objstore.storage_options, settings=_quiet())
    n = len(Cache(written).index.chunks)
    assert first.chunks_fetched == n and first.bytes > 0
    again = prefetch(url, tmp_path / "cc", objstore.storage_options, settings=_quiet())
    assert again.chunks_fetched == 0 and again.hits == n
