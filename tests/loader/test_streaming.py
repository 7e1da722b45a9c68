"""StreamingDataset against real servers: lazy opening, cache reuse, the byte budget."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from torch.utils.data import DataLoader

from asynccache import CacheDataLoader, Settings, StreamingDataset
from asynccache.write.upload import upload
from tests.helpers import assert_same
from tests.loader.datasets import DictDataset

N = 60


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds")
    list(CacheDataLoader(DictDataset(N), cache_dir=path, chunk_size=6, batch_size=10))
    return path


def chunk_bytes(root) -> int:
    """Bytes of published chunks under ``root`` (files evicted while we look count 0)."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.startswith("chunk-") and f.endswith(".bin"):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(d, f))
    return total


def test_opening_reads_only_the_index(written, http_origin, tmp_path):
    server = http_origin(written)
    ds = StreamingDataset(server.url, cache_dir=tmp_path / "c")
    # index.json and its column sidecar (index version 2), no chunk
    sidecar = json.loads((written / "index.json").read_text())["columns"]["filename"]
    assert [r.path.rsplit("/", 1)[-1] for r in server.requests] == ["index.json", sidecar]
    assert len(ds) == N and chunk_bytes(tmp_path / "c") == 0
    first = next(iter(ds))
    assert_same(DictDataset(N)[0], first)


def test_second_epoch_reuses_the_cache(written, objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    upload(written, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    ds = StreamingDataset(
        url, cache_dir=tmp_path / "c", shuffle=True, storage_options=objstore.storage_options
    )
    chunks = len(ds.index.chunks)
    epoch0 = [x["i"] for x in ds]
    fetched = ds.source.stats.chunks_fetched
    assert fetched == chunks and sorted(epoch0) == list(range(N))
    ds.set_epoch(1)
    epoch1 = [x["i"] for x in ds]
    assert sorted(epoch1) == list(range(N)) and epoch1 != epoch0
    assert ds.source.stats.chunks_fetched == fetched, "nothing downloaded twice"
    assert ds.source.stats.hits >= chunks


def test_streaming_stays_within_the_budget(written, objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    upload(written, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    size = max(c.bytes for c in StreamingDataset(written).index.chunks)
    budget = 3 * size
    ds = StreamingDataset(
        url,
        cache_dir=tmp_path / "c",
        storage_options=objstore.storage_options,
        max_cache_bytes=budget,
        shuffle=True,
        shuffle_window=2,
    )
    peak = 0
    seen = []
    for item in ds:
        seen.append(item["i"])
        pinned = sum(1 for _ in ds.source.store.pinned()) if ds.source.store else 0
        peak = max(peak, chunk_bytes(tmp_path / "c") - pinned * size)
    assert sorted(seen) == list(range(N))
    # While running, a prefetch may be published between the two reads above: one chunk.
    assert peak <= budget + size, f"cache held {peak} unpinned bytes, budget {budget}"
    assert chunk_bytes(tmp_path / "c") <= budget, "all released: within the budget"


def test_works_with_a_plain_torch_dataloader(written):
    ds = StreamingDataset(written, shuffle=True, seed=3)
    seen = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        seen.append(torch.cat([b["i"] for b in DataLoader(ds, batch_size=7, num_workers=2)]))
    for order in seen:
        assert sorted(order.tolist()) == list(range(N))
    assert seen[0].tolist() != seen[1].tolist()


def test_random_access_and_transform(written):
    ds = StreamingDataset(written, transform=lambda item: item["i"] * 2)
    assert ds[7] == 14 and ds[N - 1] == 2 * (N - 1)
    with pytest.raises(IndexError):
        ds[N]


@pytest.mark.timeout(30)
def test_index_behind_a_failing_server_gives_up_in_bounded_time(written, http_origin, tmp_path):
    from asynccache import RetriesExhaustedError
    from asynccache.testing.faults import Fault, FaultProxy

    server = http_origin(written)
    settings = Settings.from_env(retries=2, backoff_base_s=0.01, backoff_max_s=0.05)
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("status", times=2, status=503, path="index.json"))
        ds = StreamingDataset(proxy.url, cache_dir=tmp_path / "a", settings=settings)
        assert len(ds) == N, "two 503s, then the retry succeeds"
        proxy.add_fault(Fault("status", times=10, status=500, path="index.json"))
        with pytest.raises(RetriesExhaustedError, match=r"index\.json after 3 attempts"):
            StreamingDataset(proxy.url, cache_dir=tmp_path / "b", settings=settings)
