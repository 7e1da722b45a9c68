"""The downloader on a link of slow connections: a straggling part split onto idle
connections, and a prefetch window whose parts wait for free slots in the reader's order.

Real downloads through ``FaultProxy`` (its per-connection cap makes each request slow, so
parts end far apart); no test bounds a duration: each checks the requests the proxy saw,
the downloader's counters, and every byte of the chunks.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import time

import pytest
from dl_support import make_chunks

from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import ChunkSpec, Downloader
from asynccache.download.link import link_for
from asynccache.download.parts import Span
from asynccache.storage import open_storage
from asynccache.testing.faults import Fault, FaultProxy

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
BIG, SMALL = 6 * MiB, 1 * MiB  # one chunk: a long first part and a short second one
RATE = 8_000_000  # bytes/s per connection through the proxy


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    src = tmp_path_factory.mktemp("split-src")
    return src, make_chunks(src, [BIG + SMALL, 4 * MiB, 4 * MiB, 4 * MiB], seed=5)


def _downloader(tmp_path, lt, url: str, **kw) -> tuple[Downloader, ChunkStore]:
    settings = Settings.from_env(
        {},
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        retries=3,
        backoff_base_s=0.01,
        **kw,
    )
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 30)
    return Downloader(storage, store, settings, loop_thread=lt), store


def _known_link(url: str) -> None:
    """What parts of an earlier epoch would have measured: 1 ms to the first byte at
    RATE (a split needs a known link)."""
    link = link_for(url)
    for _ in range(3):
        link.observe(0.001, RATE // 2, 0.5)


def _gets(proxy: FaultProxy, name: str) -> list[tuple[int, int]]:
    """The ``[start, end)`` of every ranged GET of ``name`` the proxy saw, in order."""
    out = []
    for r in proxy.requests:
        if r.method == "GET" and name in r.path and r.range:
            start, _, last = r.range[len("bytes=") :].partition("-")
            out.append((int(start), int(last) + 1))
    return out


def test_span_cut_moves_the_end_down_and_hands_back_the_rest() -> None:
    span = Span(0, 100)
    span.cursor = 30
    assert span.cut(65) == (65, 100) and span.end == 65 and span.left == 35
    for bad in (30, 65, 70):  # at the cursor, at the end, past the end
        with pytest.raises(ValueError, match="cannot cut"):
            span.cut(bad)


def test_a_straggler_is_split_onto_idle_connections(tmp_path, lt, http_origin, chunks) -> None:
    """Parts of 6 MiB and 1 MiB on 4 connections: when the short one lands, the long
    one's rest goes out on the idle connections. Each byte is written once (the
    downloader's byte counter is the chunk's size) and the chunk verifies."""
    src, data = chunks
    name = "chunk-0-0.bin"
    body, checksum = data[name]
    with FaultProxy(http_origin(src).url, conn_bytes_per_s=RATE) as proxy:
        _known_link(proxy.url)
        dl, _store = _downloader(
            tmp_path, lt, proxy.url, max_concurrency=4, part_bytes=BIG, adaptive_parts=False
        )
        try:
            path = dl.ensure(name, len(body), checksum).result(30)
            stats = dl.snapshot()
        finally:
            dl.close()
        gets = _gets(proxy, name)
        assert proxy.link_fired("cap") > 0
    with open(path, "rb") as f:
        assert f.read() == body  # verified and published whole
    assert stats.splits >= 1, gets
    assert stats.bytes == len(body), "a byte was written twice (or lost)"
    assert gets[:2] == [(0, BIG), (BIG, BIG + SMALL)]  # the parts as first sent
    split = sorted(gets[2:])
    assert len(split) == stats.splits and all(0 < s < e <= BIG for s, e in split)
    # A split-off range may itself be split later: requests overlap as asked, never as
    # received (the byte counter above); each starts at a cut point of its own.
    assert len({s for s, _ in split}) == len(split)
    assert stats.retries == 0


def test_a_split_part_that_fails_retries_only_its_range(tmp_path, lt, http_origin, chunks) -> None:
    """The first request for a split-off range is reset after 64 KiB: it resumes at the
    byte where it stopped, up to its own end; the part it came from is not asked again."""
    src, data = chunks
    name = "chunk-0-0.bin"
    body, checksum = data[name]
    with FaultProxy(http_origin(src).url, conn_bytes_per_s=RATE) as proxy:
        # Split requests end where the long part ends and start after byte 0 (the long
        # part's own request is bytes=0-..., the short one's ends later).
        proxy.add_fault(
            Fault("reset", path=name, range=f"-{BIG - 1}", from_byte=1, after_bytes=64 << 10)
        )
        _known_link(proxy.url)
        dl, _store = _downloader(
            tmp_path, lt, proxy.url, max_concurrency=4, part_bytes=BIG, adaptive_parts=False
        )
        try:
            path = dl.ensure(name, len(body), checksum).result(30)
            stats = dl.snapshot()
        finally:
            dl.close()
        gets = _gets(proxy, name)
        assert proxy.fired("reset") == 1
    with open(path, "rb") as f:
        assert f.read() == body
    assert stats.splits >= 1 and stats.retries == 1
    assert stats.bytes == len(body), "the retry fetched bytes it already had"
    first_split = next(g for g in gets[2:] if g[1] == BIG)
    resumed = [g for g in gets[2:] if g[0] == first_split[0] + (64 << 10)]
    assert len(resumed) == 1 and resumed[0][1] <= BIG, gets  # its own range, from the cut
    assert gets.count((0, BIG)) == 1 and gets.count((BIG, BIG + SMALL)) == 1


def test_the_window_starts_a_chunk_as_parts_of_the_one_before_land(
    tmp_path, lt, http_origin, chunks
) -> None:
    """Three hinted chunks of 4 parts on 6 connections, the first chunk's last part
    paused for 1 s: the second chunk starts once parts of the first have landed (its 4
    parts then fit beside those left), not when the whole first chunk has; the third
    waits for room the same way. Every chunk arrives intact, each byte once."""
    src, data = chunks
    names = ["chunk-0-1.bin", "chunk-0-2.bin", "chunk-0-3.bin"]
    with FaultProxy(http_origin(src).url, conn_bytes_per_s=4 * RATE) as proxy:
        proxy.add_fault(
            Fault("slow", path=names[0], from_byte=3 * MiB, after_bytes=64 << 10, stall_s=1.0)
        )
        dl, store = _downloader(
            tmp_path,
            lt,
            proxy.url,
            max_concurrency=6,
            part_bytes=MiB,
            adaptive_parts=False,
            prefetch_chunks=3,
        )
        try:
            dl.hint([ChunkSpec(n, len(data[n][0]), data[n][1]) for n in names])
            deadline = time.monotonic() + 30
            while not all(store.is_cached(n) for n in names):
                assert time.monotonic() < deadline, "the window did not land"
                time.sleep(0.01)
            while dl.snapshot().chunks_fetched < len(names):  # (counted just after its publish)
                assert time.monotonic() < deadline, "a chunk that landed was never counted"
                time.sleep(0.01)
            stats = dl.snapshot()
        finally:
            dl.close()
        reqs = [r for r in proxy.requests if r.method == "GET"]
        assert proxy.fired("slow") == 1
    assert stats.chunks_fetched == 3 and stats.bytes == sum(len(data[n][0]) for n in names)
    for before, after in itertools.pairwise(names):
        ends = sorted(r.ended for r in reqs if before in r.path)
        first = min(r.at for r in reqs if after in r.path)
        assert len(ends) == 4 and ends[0] < first, "started before any part of the one before"
        if before == names[0]:  # its paused part ends 1 s after the others
            assert first < ends[-1], "waited for the whole chunk before it"
    for n in names:
        with open(store.path(n), "rb") as f:
            assert f.read() == data[n][0]


def test_a_chunk_another_process_downloads_counts_one_part_in_the_window(
    tmp_path, lt, http_origin, chunks
) -> None:
    """Another holder of a chunk's download lock (the main process's head start, or a
    worker sharing the chunk) uses none of this process's connections: the window
    counts it as one part, so the next chunk starts beside it (4 MiB chunks in 1 MiB
    parts on 6 connections: counted whole, the locked chunk's 4 parts would leave no
    room for the next one's 4 until the lock is free). The locked chunk is fetched once
    the lock is free; every chunk arrives intact, each byte once."""
    src, data = chunks
    names = ["chunk-0-1.bin", "chunk-0-2.bin", "chunk-0-3.bin"]
    with FaultProxy(http_origin(src).url, conn_bytes_per_s=4 * RATE) as proxy:
        dl, store = _downloader(
            tmp_path,
            lt,
            proxy.url,
            max_concurrency=6,
            part_bytes=MiB,
            adaptive_parts=False,
            prefetch_chunks=3,
        )
        lock = store.lock_path(names[0])
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: another holder
            dl.hint([ChunkSpec(n, len(data[n][0]), data[n][1]) for n in names])
            deadline = time.monotonic() + 30
            while not store.is_cached(names[1]) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store.is_cached(names[1]), "the next chunk waited for the locked one"
            assert not [r for r in proxy.requests if names[0] in r.path]
        finally:
            os.close(fd)  # the other holder is done (without publishing)
        try:
            deadline = time.monotonic() + 30
            while not all(store.is_cached(n) for n in names):
                assert time.monotonic() < deadline, "the window did not land"
                time.sleep(0.01)
            while dl.snapshot().chunks_fetched < len(names):  # (counted just after its publish)
                assert time.monotonic() < deadline, "a chunk that landed was never counted"
                time.sleep(0.01)
            stats = dl.snapshot()
        finally:
            dl.close()
    assert stats.chunks_fetched == 3 and stats.bytes == sum(len(data[n][0]) for n in names)
    for n in names:
        with open(store.path(n), "rb") as f:
            assert f.read() == data[n][0]
