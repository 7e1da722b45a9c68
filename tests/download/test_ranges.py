"""Range reads of the first batch (download/ranges.py) through ``Storage.receive_into``.

A real HTTP origin behind the real fault proxy, the real downloader: both receive paths
(``ASYNCCACHE_RECEIVE=direct`` and ``aiohttp``) give the same bytes and the same errors,
a fault is survived by resuming at the first byte not received (and really fired), and
the direct path receives the ranges itself (nothing handed to aiohttp).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import Downloader
from asynccache.errors import ObjectNotFoundError, RetriesExhaustedError
from asynccache.storage import open_storage
from asynccache.storage.wire import DirectPool
from asynccache.testing.faults import Fault, FaultProxy
from asynccache.torch.streaming import StreamingDataset
from tests.helpers import noise_item, uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(60)

PATHS = ("direct", "aiohttp")
SIZE = 600_000
DATA = bytes((i * 13 + i // 509) & 0xFF for i in range(SIZE))
RANGES = [(0, 64), (1000, 200_000), (300_001, SIZE)]


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "chunk-0-0.bin").write_bytes(DATA)
    return d


def _downloader(tmp_path, lt, url: str, receive: str, **kw) -> Downloader:
    settings = Settings(
        cache_dir=str(tmp_path / "cache"),
        receive=receive,
        retries=kw.pop("retries", 3),
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        timeout_s=5.0,
        max_concurrency=4,
        progress=False,
    )
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / receive, max_cache_bytes=1 << 30)
    return Downloader(storage, store, settings, loop_thread=lt)


def _pool(dl: Downloader) -> DirectPool | None:
    return dl.storage._sessions.direct()  # type: ignore[attr-defined]


def test_both_paths_give_the_same_bytes_and_resume_after_a_reset(
    tmp_path, lt, src, http_origin
) -> None:
    got = {}
    for receive in PATHS:
        with FaultProxy(http_origin(src).url) as proxy:
            # The middle range's connection is reset after 50,000 bytes: resumed there.
            proxy.add_fault(Fault("reset", range="bytes=1000-", after_bytes=50_000))
            dl = _downloader(tmp_path, lt, proxy.url, receive)
            try:
                got[receive] = [
                    bytes(a) for a in dl.read_ranges("chunk-0-0.bin", RANGES).result(30)
                ]
                stats = dl.snapshot()
                pool = _pool(dl)
            finally:
                dl.close()
            assert proxy.fired("reset") == 1, receive  # the fault really happened
            resumed = [
                r.range
                for r in proxy.requests
                if r.range
                and r.range.startswith("bytes=")
                and not r.range.startswith("bytes=1000-")
                and r.range.endswith("-199999")
            ]
        assert got[receive] == [DATA[a:b] for a, b in RANGES], receive
        assert len(resumed) == 1, (receive, resumed)  # one retry, from past the first byte
        assert int(resumed[0][6:].split("-")[0]) > 1000
        assert stats.range_gets == len(RANGES) + 1 and stats.retries == 1
        assert stats.range_bytes == sum(b - a for a, b in RANGES)
        if receive == "direct":  # received by our own receiver, nothing left to aiohttp
            assert pool is not None and pool.connects >= 1 and pool.handed_back == 0
        else:
            assert pool is None
    assert got["direct"] == got["aiohttp"]


def test_both_paths_give_the_same_errors(tmp_path, lt, src, http_origin) -> None:
    seen = {}
    for receive in PATHS:
        with FaultProxy(http_origin(src).url) as proxy:
            proxy.add_fault(Fault("status", status=500, times=10, range="bytes=64-"))
            dl = _downloader(tmp_path, lt, proxy.url, receive, retries=1)
            try:
                with pytest.raises(ObjectNotFoundError) as missing:
                    dl.read_ranges("chunk-9-9.bin", [(0, 10)]).result(30)
                with pytest.raises(RetriesExhaustedError) as spent:
                    dl.read_ranges("chunk-0-0.bin", [(64, 128)]).result(30)
                pool = _pool(dl)
            finally:
                dl.close()
            assert proxy.fired("status") == 2, receive  # both attempts met the fault
        assert f"{proxy.url}/chunk-9-9.bin" in str(missing.value)
        assert f"{proxy.url}/chunk-0-0.bin" in str(spent.value)
        assert "500" in str(spent.value.__cause__)
        if receive == "direct":
            assert pool is not None and pool.handed_back == 0
        seen[receive] = (type(missing.value), type(spent.value), type(spent.value.__cause__))
    assert seen["direct"] == seen["aiohttp"]


def test_throttling_is_waited_out_not_counted_as_retries(tmp_path, lt, src, http_origin) -> None:
    """Four SlowDown answers in a row, with a retry budget of one: a range read waits them
    out (they count against the throttle patience, not against the retries)."""
    with FaultProxy(http_origin(src).url) as proxy:
        proxy.add_fault(Fault("slowdown", times=4, range="bytes=64-"))
        dl = _downloader(tmp_path, lt, proxy.url, "direct", retries=1)
        try:
            (got,) = dl.read_ranges("chunk-0-0.bin", [(64, 128)]).result(30)
        finally:
            dl.close()
        assert proxy.fired("slowdown") == 4
    assert bytes(got) == DATA[64:128]


def test_a_datasets_first_items_by_range_are_the_same_both_ways(objstore, tmp_path) -> None:
    """The reader's first items come by range under either receive path, as the same
    items, bit for bit (the first chunk's whole GET is held back, so they must)."""
    n, per_chunk, item = 64, 32, 48 << 10  # chunks of 1.5 MiB: range reads start at 1 MiB
    src = write_noise_dataset(tmp_path / "src", n, per_chunk, item)
    name = sorted(f for f in os.listdir(src) if f.endswith(".bin"))[0]
    size = (src / name).stat().st_size
    got = {}
    with uploaded(src, objstore, "ranges") as url:
        for receive in PATHS:
            with FaultProxy(objstore.endpoint_url) as proxy:
                proxy.add_fault(Fault("slow", path=name, range=f"bytes=0-{size - 1}", stall_s=0.5))
                settings = Settings.from_env(
                    progress=False, first_read_bytes=8 * item, receive=receive
                )
                ds = StreamingDataset(
                    url,
                    cache_dir=tmp_path / f"cc-{receive}",
                    storage_options=dict(objstore.storage_options, endpoint_url=proxy.url),
                    settings=settings,
                )
                try:
                    got[receive] = list(ds)
                    stats = ds.source.stats
                finally:
                    ds.close()
                assert proxy.fired("slow") == 1, receive
            assert stats.range_gets == 2 and stats.range_bytes > 0, (receive, stats)
            assert [g["i"] for g in got[receive]] == list(range(n))
            for g in got[receive]:
                np.testing.assert_array_equal(g["x"], noise_item(g["i"], item)["x"])
    for a, b in zip(got["direct"], got["aiohttp"], strict=True):
        assert a["i"] == b["i"] and bytes(a["x"]) == bytes(b["x"])
