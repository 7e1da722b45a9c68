"""A mix and a subsample read from SeaweedFS: each chunk downloaded once per node, and a
subsample downloads only its own chunks (GETs counted by a fault proxy without faults,
and the download statistics of every worker)."""

from __future__ import annotations

import collections
import os

import pytest

from asynccache import CacheDataLoader, ConfigError, StreamingDataset
from asynccache.config import Settings
from asynccache.sampling.order import ReadOrder
from asynccache.testing.faults import FaultProxy
from asynccache.torch.mixed import MixedDataset, Stream
from tests.loader.mix_data import (
    CHUNK,
    SIZES,
    WEIGHTS,
    chunk_files,
    pairs,
    upload_streams,
    write_streams,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory):
    bucket = "mix-" + os.urandom(4).hex()
    objstore.create_bucket(bucket)
    src = str(tmp_path_factory.mktemp("mix-src"))
    return upload_streams(objstore, write_streams(src), bucket)


@pytest.fixture
def proxy(objstore):
    with FaultProxy(objstore.endpoint_url) as p:
        yield p


def chunk_gets(proxy) -> collections.Counter[str]:
    """GETs per chunk object (full path: the streams' chunks share names)."""
    return collections.Counter(
        r.path for r in proxy.requests if r.method == "GET" and "/chunk-" in r.path
    )


def test_mix_downloads_each_chunk_once_per_node(remote, objstore, proxy, tmp_path):
    cache = str(tmp_path / "cache")
    opts = dict(objstore.storage_options, endpoint_url=proxy.url)
    streams = [
        Stream(
            StreamingDataset(u, cache_dir=cache, shuffle=True, seed=s, storage_options=opts),
            weight=w,
        )
        for s, (u, w) in enumerate(zip(remote, WEIGHTS, strict=True))
    ]
    ds = MixedDataset(streams, mode="per_stream", batch_size=8, seed=1)
    assert ds.stream_counts == [296, 176, 120]  # stream 2 wraps: 1.2 passes
    batches = list(CacheDataLoader(ds, batch_size=8, num_workers=2))
    got = collections.Counter(s for s, _ in pairs(batches))
    assert got == {0: 296, 1: 176, 2: 120}
    chunks = sum(-(-n // CHUNK) for n in SIZES)
    gets = chunk_gets(proxy)
    assert len(gets) == chunks and set(gets.values()) == {1}, "each chunk downloaded once"
    assert len(chunk_files(cache)) == chunks
    # the workers' statistics saw them all (an index sidecar, where the index has one,
    # is fetched by the same downloader: at most one more per stream)
    assert chunks <= ds.download_stats()["chunks_fetched"] <= chunks + len(SIZES)


def test_subsample_downloads_only_its_chunks(remote, objstore, proxy, tmp_path):
    cache = str(tmp_path / "cache")
    ds = StreamingDataset(
        remote[0],
        cache_dir=cache,
        shuffle=True,
        seed=9,
        subsample=0.1,
        storage_options=dict(objstore.storage_options, endpoint_url=proxy.url),
    )
    keys = [int(k) for b in CacheDataLoader(ds, batch_size=4, num_workers=2) for k in b["i"]]
    chosen = ReadOrder(ds.units, ds.order_spec, 0).chunks
    assert chosen is not None and len(keys) == len(chosen) * CHUNK
    names = sorted(ds.index.chunks[c].filename for c in chosen)
    assert len(names) == 2 and chunk_files(cache) == names
    gets = chunk_gets(proxy)
    assert sorted(p.rsplit("/", 1)[1] for p in gets) == names and set(gets.values()) == {1}
    assert 2 <= ds.download_stats()["chunks_fetched"] <= 3


def test_a_budget_below_the_sum_of_the_streams_minimums_is_refused(remote, objstore, tmp_path):
    def mixed(budget: int | None, cache: str) -> MixedDataset:
        streams = [
            StreamingDataset(
                u,
                cache_dir=cache,
                shuffle=True,
                seed=s,
                max_cache_bytes=budget,
                storage_options=objstore.storage_options,
            )
            for s, u in enumerate(remote)
        ]
        return MixedDataset(streams, seed=1)

    ds = mixed(None, str(tmp_path / "a"))
    next(iter(ds))  # plans every stream
    mins = [st.source.plan_min_bytes for st in ds.streams]
    assert all(m > 0 for m in mins)
    tight = mixed(sum(mins) - 1, str(tmp_path / "b"))  # each stream's own minimum fits
    with pytest.raises(ConfigError, match="sum of the mixed streams' minimums"):
        next(iter(tight))
    assert next(iter(mixed(sum(mins), str(tmp_path / "c")))) is not None


def test_a_mix_shares_one_concurrency_limit_per_process(remote, objstore, proxy, tmp_path):
    # ASYNCCACHE_MAX_CONCURRENCY bounds the downloads in flight per process: three streams
    # read in one process with a limit of 1 never have two chunk GETs open at once. The
    # proxy's first-byte latency keeps each GET open long enough for overlaps to show.
    proxy.set_link(latency_s=0.05)
    settings = Settings.from_env(max_concurrency=1, progress=False)
    opts = dict(objstore.storage_options, endpoint_url=proxy.url)
    streams = [
        Stream(
            StreamingDataset(
                u, cache_dir=str(tmp_path / "c"), storage_options=opts, settings=settings
            ),
            weight=w,
        )
        for u, w in zip(remote, WEIGHTS, strict=True)
    ]
    ds = MixedDataset(streams, mode="random", batch_size=8, seed=2)
    opened = proxy.peak_open  # the streams' index files, fetched as each opened
    assert sum(1 for _ in ds) == sum(ds.stream_counts)
    assert proxy.link_fired("latency") > len(SIZES), "the latency knob slowed the chunk GETs"
    assert proxy.peak_open == 1, (opened, proxy.peak_open)
