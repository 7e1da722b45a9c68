"""The workers' first chunks, started by the main process while the workers start.

Through a fault proxy with first-byte latency and a per-connection cap in front of
SeaweedFS, with real DataLoader workers: the main process of a CacheDataLoader starts
downloading each worker's first chunk once its own first batches are read by range; the
workers then find those chunks downloading (their download lock held) and wait for the
published name. Each chunk is fetched once, and what the main process started ends with
the epoch. Nothing here is timed.
"""

from __future__ import annotations

import collections
import os
import time
import uuid

import numpy as np
import pytest
import torch

from asynccache import CacheDataLoader, Settings, StreamingDataset
from asynccache.testing.faults import Fault, FaultProxy
from asynccache.torch import lead
from asynccache.write.upload import upload
from asynccache.write.writer import ChunkWriter, merge_dir

pytestmark = pytest.mark.timeout(120)

ITEM_BYTES = 20_000
ITEMS = 512  # 8 chunks of 64 items (1.28 MB each: large enough to be read by range)
CHUNK_BYTES = 64 * (ITEM_BYTES + 512)
BATCH = 16
MAIN_ROW = -1  # the main process's row of the dataset's download statistics


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory):
    src = tmp_path_factory.mktemp("head-src")
    w = ChunkWriter(str(src), 0, chunk_bytes=CHUNK_BYTES)
    rng = np.random.default_rng(1)
    for i in range(ITEMS):
        w.add(i, {"i": i, "x": rng.integers(0, 255, ITEM_BYTES, dtype=np.uint8)})
    w.finish()
    index = merge_dir(str(src), [0])
    assert index.num_chunks == 8 and min(c.bytes for c in index.chunks) > 1 << 20
    bucket = f"head-{uuid.uuid4().hex[:8]}"
    objstore.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    upload(str(src), url, objstore.storage_options, settings=Settings.from_env(progress=False))
    return url, index


def _loader(
    remote, proxy, objstore, cache_dir, max_cache_bytes=None
) -> tuple[CacheDataLoader, StreamingDataset]:
    ds = StreamingDataset(
        remote[0],
        cache_dir=cache_dir,
        storage_options=dict(objstore.storage_options, endpoint_url=proxy.url),
        settings=Settings.from_env(head_start=True, max_cache_bytes=max_cache_bytes),
    )
    return CacheDataLoader(ds, batch_size=BATCH, num_workers=2), ds


def _whole_gets(requests, index) -> collections.Counter[str]:
    """GETs of a whole chunk per chunk (each chunk here is one part: under 2 MiB), not
    the first batches' range reads of a header or of items."""
    whole = {c.filename: f"bytes=0-{c.bytes - 1}" for c in index.chunks}
    return collections.Counter(
        os.path.basename(r.path)
        for r in requests
        if r.method == "GET" and r.range and whole.get(os.path.basename(r.path)) == r.range
    )


@pytest.fixture
def slow_enough(monkeypatch):
    """Any link counts as slow enough for the head start (this dataset's chunks take
    well under the second the default asks for)."""
    monkeypatch.setattr(lead, "_HEAD_MIN_S", 0.0)
    monkeypatch.setattr(lead, "_HEAD_MIN_TTFB_S", 0.0)


def test_main_process_fetches_the_workers_first_chunks_each_chunk_once(
    remote, objstore, tmp_path, slow_enough
):
    _, index = remote
    with FaultProxy(objstore.endpoint_url, latency_s=0.02, conn_bytes_per_s=4_000_000) as proxy:
        dl, ds = _loader(remote, proxy, objstore, tmp_path / "cache")
        keys = torch.cat([b["i"] for b in dl]).tolist()
        assert sorted(keys) == list(range(ITEMS))
        assert proxy.link_fired("latency") > 0 and proxy.link_fired("cap") > 0
        table = ds.shared_epoch.stat_table()
        fetched = table[:, 1]  # chunks_fetched, per process row
        # Worker 0 reads chunks 0-3, worker 1 chunks 4-7; the main process built each
        # one's first batch by range and started chunks 0 and 4 before the workers ran.
        assert fetched[MAIN_ROW] == 2, f"chunks fetched per row: {fetched[fetched > 0]}"
        assert fetched.sum() == index.num_chunks
        # Each chunk downloaded once (the workers waited for the main process's
        # downloads instead of fetching them again): every byte of it, no more.
        assert table[:, 0].sum() == sum(c.bytes for c in index.chunks)
        assert _whole_gets(proxy.requests, index) == {c.filename: 1 for c in index.chunks}
        # The main process's downloads (chunks 0 and 4) held until the first batches'
        # range reads were in (they share its connections). (On this link the workers
        # start at once, beside those batches: their own later chunks may go out before.)
        whole = {c.filename: f"bytes=0-{c.bytes - 1}" for c in index.chunks}
        heads = {index.chunks[0].filename, index.chunks[4].filename}
        gets = [r for r in proxy.requests if r.method == "GET" and r.range and "chunk-" in r.path]
        parts = [
            r.at
            for r in gets
            if whole[os.path.basename(r.path)] == r.range and os.path.basename(r.path) in heads
        ]
        ranges = [r.at for r in gets if whole[os.path.basename(r.path)] != r.range]
        assert ranges and max(ranges) < min(parts)
        before = len(proxy.requests)
        keys = torch.cat([b["i"] for b in dl]).tolist()  # the second epoch: all cached
        assert sorted(keys) == list(range(ITEMS))
        assert not [r for r in proxy.requests[before:] if "chunk-" in r.path]
        assert ds.shared_epoch.stat_table()[:, 1].sum() == index.num_chunks


def test_under_a_budget_the_main_process_starts_nothing(remote, objstore, tmp_path):
    _, index = remote
    total = sum(c.bytes for c in index.chunks)
    with FaultProxy(objstore.endpoint_url, latency_s=0.02) as proxy:
        dl, ds = _loader(
            remote, proxy, objstore, tmp_path / "cache", max_cache_bytes=total * 3 // 4
        )
        keys = torch.cat([b["i"] for b in dl]).tolist()
        assert sorted(keys) == list(range(ITEMS))
        assert proxy.link_fired("latency") > 0
        table = ds.shared_epoch.stat_table()
        assert table[MAIN_ROW, 1] == 0  # its reservations would not follow the plan
        assert table[:, 1].sum() == index.num_chunks
        assert table[:, 0].sum() == total


def test_on_a_fast_link_the_workers_fetch_their_own(remote, objstore, tmp_path, monkeypatch):
    """A link judged fast (the thresholds raised, so a loaded machine's slow loopback
    counts as fast too): the main process cancels the head chunks once its first batches
    are built, and the workers fetch them, each once."""
    monkeypatch.setattr(lead, "_HEAD_MIN_S", 1e9)
    monkeypatch.setattr(lead, "_HEAD_MIN_TTFB_S", 1e9)
    _, index = remote
    with FaultProxy(objstore.endpoint_url) as proxy:
        dl, ds = _loader(remote, proxy, objstore, tmp_path / "cache")
        keys = torch.cat([b["i"] for b in dl]).tolist()
        assert sorted(keys) == list(range(ITEMS))
        table = ds.shared_epoch.stat_table()
        assert table[MAIN_ROW, 1] == 0
        assert table[:, 1].sum() == index.num_chunks
        assert _whole_gets(proxy.requests, index) == {c.filename: 1 for c in index.chunks}


def test_what_the_main_process_started_ends_with_the_epoch(remote, objstore, tmp_path, slow_enough):
    _, index = remote
    cache = tmp_path / "cache"
    firsts = [index.filename(0), index.filename(4)]
    with FaultProxy(objstore.endpoint_url, latency_s=0.02) as proxy:
        # The whole-chunk GETs of the workers' first chunks pause after 64 KiB, so they
        # are still downloading when the consumer stops after the first batch.
        for ci in (0, 4):
            whole = f"bytes=0-{index.chunks[ci].bytes - 1}"
            proxy.add_fault(
                Fault(
                    "slow", path=index.filename(ci), range=whole, after_bytes=64 << 10, stall_s=20
                )
            )
        dl, ds = _loader(remote, proxy, objstore, cache)
        it = iter(dl)
        next(it)  # built here from range reads; the head start begins
        down = ds.source.downloader()
        deadline = time.monotonic() + 30
        while proxy.fired("slow") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.fired("slow") == 2, "the head start never began"
        assert all(down.in_flight(n) for n in firsts)
        it.close()  # the epoch ends early: its workers shut down, its downloads end
        deadline = time.monotonic() + 30
        while any(down.in_flight(n) for n in firsts) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(down.in_flight(n) for n in firsts), "left running after the epoch"
        assert down.snapshot().chunks_fetched == 0  # cancelled, not finished
        mine = f".{os.getpid()}."
        leftovers = [p.name for p in cache.rglob("*.tmp") if mine in p.name]
        assert leftovers == [], f"temporary files left by the main process: {leftovers}"
        ds.close()
