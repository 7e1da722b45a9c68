"""The prefetch window in bytes: small chunks get a deeper window, up to one part per
connection at the size the link calls for, bounded by the cache budget.

No test bounds a duration: each checks which chunks the downloader fetched ahead (the
GETs the proxy saw, the chunks published), that the link knobs fired, and that every
byte arrived intact.
"""

from __future__ import annotations

import time

import pytest
from dl_support import make_chunks

from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import ChunkSpec, Downloader
from asynccache.download.link import LinkEstimate, window_bytes
from asynccache.storage import open_storage
from asynccache.testing.faults import FaultProxy

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
SMALL = 200 << 10  # under 256 KiB: no rate is taken from them, so parts stay at the start
NAMES = [f"chunk-0-{i}.bin" for i in range(12)]


def test_window_bytes_is_one_part_per_connection_within_a_quarter_of_the_budget() -> None:
    settings = Settings.from_env({})
    unknown = LinkEstimate()
    assert window_bytes(settings, unknown, 1 << 40) == 16 * 8 * MiB  # 16 x PART_BYTES
    # A link whose first byte waits long on fast connections wants larger parts, and so
    # a window of at least its bandwidth-delay product (here 10 x 0.1 s x 32 MB/s).
    slow_start = LinkEstimate()
    slow_start.observe(0.1, 32 * MiB, 1.0)
    assert window_bytes(settings, slow_start, 1 << 40) == 16 * 32 * MiB
    assert window_bytes(settings, slow_start, 1 << 40) >= 16 * 0.1 * 32 * MiB
    assert window_bytes(settings, unknown, 64 * MiB) == 16 * MiB  # the budget's quarter
    fixed = Settings.from_env({"ASYNCCACHE_PART_BYTES": "8MiB"})
    assert window_bytes(fixed, unknown, 1 << 40) == 0  # a fixed part size: chunks only


@pytest.fixture(scope="module")
def small_chunks(tmp_path_factory):
    src = tmp_path_factory.mktemp("window-src")
    return src, make_chunks(src, [SMALL] * len(NAMES), seed=23)


def _fetched_ahead(tmp_path, lt, url: str, data: dict, budget: int, **kw) -> list[str]:
    """Hint all the chunks, read none, and wait (bounded) until the downloader rests:
    the chunks it published, in hint order. Each published chunk is checked whole."""
    settings = Settings.from_env(
        {},
        cache_dir=str(tmp_path / "cache"),
        max_concurrency=2,
        prefetch_chunks=2,
        retries=1,
        progress=False,
        **kw,
    )
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=budget)
    dl = Downloader(storage, store, settings, loop_thread=lt)
    try:
        dl.hint(ChunkSpec(n, len(data[n][0]), data[n][1]) for n in NAMES)
        deadline = time.monotonic() + 30
        calm = 0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            # At rest: the window's first chunk published and nothing in flight, twice
            # in a row (the window never shrinks here: nothing is read).
            busy = any(dl.in_flight(n) for n in NAMES)
            calm = calm + 1 if store.is_cached(NAMES[0]) and not busy else 0
            if calm == 2:
                break
        else:
            pytest.fail("the prefetch window did not come to rest within 30 s")
        cached = [n for n in NAMES if store.is_cached(n, SMALL)]
        for name in cached:
            with open(store.path(name), "rb") as f:
                assert f.read() == data[name][0], name
        return cached
    finally:
        dl.close()


def _gets(proxy: FaultProxy) -> dict[str, int]:
    seen: dict[str, int] = {}
    for r in proxy.requests:
        if r.method == "GET" and r.path.endswith(".bin"):
            name = r.path.rsplit("/", 1)[-1]
            seen[name] = seen.get(name, 0) + 1
    return seen


def test_small_chunks_get_a_window_of_bytes_bounded_by_the_budget(
    tmp_path, lt, http_origin, small_chunks
) -> None:
    src, data = small_chunks
    origin = http_origin(src)
    start = 1 * MiB  # the part size adaptation starts from (the bounds raise it to 2 MiB)
    with FaultProxy(origin.url, latency_s=0.02, conn_bytes_per_s=4_000_000) as proxy:
        dl_kw = dict(part_bytes=start, adaptive_parts=True)
        deep = _fetched_ahead(tmp_path / "deep", lt, proxy.url, data, 1 << 30, **dl_kw)
        deep_gets = _gets(proxy)
        budget = 2 * MiB  # a quarter of it is 512 KiB: three chunks of 200 KiB
        tight = _fetched_ahead(tmp_path / "tight", lt, proxy.url, data, budget, **dl_kw)
        fixed = _fetched_ahead(tmp_path / "fixed", lt, proxy.url, data, 1 << 30, part_bytes=start)
        assert proxy.link_fired("latency") > 0 and proxy.link_fired("cap") > 0
    # Two connections x a 2 MiB part (PartBounds().lo) = 4 MiB of window: 2 chunks of
    # PREFETCH_CHUNKS, then 200 KiB chunks up to the 2 x MAX_CONCURRENCY cap of 4.
    settings = Settings.from_env({}, max_concurrency=2, prefetch_chunks=2, **dl_kw)
    assert window_bytes(settings, LinkEstimate(), 1 << 30) == 4 * MiB
    assert deep == NAMES[:4]
    assert tight == NAMES[:3]  # within a quarter of the budget
    assert fixed == NAMES[:2]  # a fixed part size: PREFETCH_CHUNKS chunks, as before
    # Each chunk fetched ahead was fetched once, in one GET (smaller than any part).
    assert deep_gets == dict.fromkeys(NAMES[:4], 1)


def test_the_hint_depth_follows_the_chunk_size(tmp_path, lt) -> None:
    settings = Settings.from_env({}, cache_dir=str(tmp_path / "cache"), progress=False)
    storage = open_storage("http://127.0.0.1:9/ds", settings)  # never contacted
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 40)
    dl = Downloader(storage, store, settings, loop_thread=lt)
    try:
        assert dl.window_depth(64 * MiB) == 4  # PREFETCH_CHUNKS holds more already
        assert dl.window_depth(8 * MiB) == 16  # 16 connections x 8 MiB parts
        assert dl.window_depth(64 << 10) == 32  # at most 2 x MAX_CONCURRENCY chunks
        assert dl.window_depth(0) == 4
    finally:
        dl.close()
