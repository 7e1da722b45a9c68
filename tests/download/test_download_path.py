"""The lean download path: parts hashed from the mapped file, spare slots used while waiting.

Real HTTP origin, real fault proxy, real downloader and cache.
"""

from __future__ import annotations

import time

import pytest
from dl_support import make_chunks

from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import ChunkSpec, Downloader
from asynccache.storage import open_storage
from asynccache.testing.faults import Fault, FaultProxy

pytestmark = pytest.mark.timeout(60)

PART = 256 << 10


def _downloader(tmp_path, lt, url, **kw) -> Downloader:
    base = dict(
        cache_dir=str(tmp_path / "cache"),
        retries=3,
        backoff_base_s=0.01,
        backoff_max_s=1.0,
        timeout_s=10.0,
        part_bytes=PART,
        max_concurrency=4,
    )
    base.update(kw)
    settings = Settings(**base)
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 30)
    return Downloader(storage, store, settings, loop_thread=lt)


def test_flip_in_a_later_part_is_caught_from_the_mapped_file(tmp_path, lt, http_origin) -> None:
    # The first part is hashed as it streams; the third only from the mapped file.
    src = tmp_path / "src"
    src.mkdir()
    chunks = make_chunks(src, [3 * PART + 1000])
    data, checksum = chunks["chunk-0-0.bin"]
    third = f"bytes={2 * PART}-"
    with FaultProxy(http_origin(src).url) as proxy:
        proxy.add_fault(Fault("flip", path="chunk-0-0", range=third, flip_at=5))
        dl = _downloader(tmp_path, lt, proxy.url)
        try:
            path = dl.ensure("chunk-0-0.bin", len(data), checksum).result(30)
        finally:
            dl.close()
        assert proxy.fired("flip") == 1
        ranges = [r.range for r in proxy.requests if r.method == "GET"]
    with open(path, "rb") as f:
        assert f.read() == data  # the damaged copy was refused and fetched again
    assert dl.stats.retries == 1
    assert sum(1 for r in ranges if r and r.startswith(third)) == 2
    assert sum(1 for r in ranges if r and r.startswith("bytes=0-")) == 2  # the whole chunk again


def test_spare_slots_prefetch_while_a_reader_waits(tmp_path, lt, http_origin) -> None:
    # A reader waits for a one-part chunk on a slow connection; the prefetch hinted
    # meanwhile takes a spare slot at once instead of waiting for the reader's chunk.
    src = tmp_path / "src"
    src.mkdir()
    chunks = make_chunks(src, [200_000, 200_000])
    (a, (data_a, sum_a)), (b, (data_b, sum_b)) = sorted(chunks.items())
    with FaultProxy(http_origin(src).url, conn_bytes_per_s=400_000) as proxy:
        dl = _downloader(tmp_path, lt, proxy.url, part_bytes=1 << 20)
        try:
            fut = dl.ensure(a, len(data_a), sum_a)
            deadline = time.monotonic() + 10
            while not proxy.count("GET", a) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proxy.count("GET", a) == 1
            dl.hint([ChunkSpec(b, len(data_b), sum_b)])
            path_a = fut.result(30)
            done_a = time.monotonic()
            path_b = dl.ensure(b, len(data_b), sum_b).result(30)
        finally:
            dl.close()
        assert proxy.link_fired("cap") >= 1  # the reader's chunk really was slow
        got_b = [r.at for r in proxy.requests if r.method == "GET" and b in r.path]
    assert len(got_b) == 1
    assert got_b[0] < done_a  # the prefetch went out while the reader still waited
    with open(path_a, "rb") as f:
        assert f.read() == data_a
    with open(path_b, "rb") as f:
        assert f.read() == data_b


@pytest.mark.parametrize("receive", ["direct", "aiohttp"])
def test_resume_after_reset_and_trickle_both_receive_paths(
    tmp_path, lt, http_origin, receive
) -> None:
    # The same faults on either receive path: a reset mid-body resumes at the next byte
    # (not from the part's start), a trickle below the floor is a stall, retried; the
    # chunk lands byte-identical.
    src = tmp_path / "src"
    src.mkdir()
    chunks = make_chunks(src, [2 * PART])
    data, checksum = chunks["chunk-0-0.bin"]
    with FaultProxy(http_origin(src).url) as proxy:
        proxy.add_fault(Fault("reset", path="chunk-0-0", range="bytes=0-", after_bytes=100_000))
        proxy.add_fault(
            Fault(
                "trickle",
                path="chunk-0-0",
                range=f"bytes={PART}-",
                after_bytes=1000,
                bytes_per_s=2000,
            )
        )
        dl = _downloader(
            tmp_path, lt, proxy.url, receive=receive, timeout_s=0.5, min_bytes_per_s=50_000
        )
        try:
            path = dl.ensure("chunk-0-0.bin", len(data), checksum).result(30)
        finally:
            dl.close()
        assert proxy.fired("reset") == 1 and proxy.fired("trickle") == 1
        ranges = [r.range for r in proxy.requests if r.method == "GET"]
    with open(path, "rb") as f:
        assert f.read() == data
    assert dl.stats.retries == 2
    resumed = [
        int(r[6:].split("-")[0])
        for r in ranges
        if r and not r.startswith(("bytes=0-", f"bytes={PART}-"))
    ]
    assert len(resumed) == 2  # both retries asked for the rest only
    assert any(0 < s <= 100_000 for s in resumed) and any(s > PART for s in resumed)
