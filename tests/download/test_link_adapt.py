"""The part size adapts to the link: the estimator's arithmetic, and real downloads through
the fault proxy's link knobs (first-byte latency, per-connection cap) choosing it.

No test bounds a duration: each checks what the downloader chose (the ranges the proxy
saw), that the link knobs fired, and that every byte arrived intact.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from dl_support import DictStorage, make_chunks
from hypothesis import given
from hypothesis import strategies as st

from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import ChunkSpec, Downloader
from asynccache.download.link import (
    FIRST_BYTE_SHARE,
    LinkEstimate,
    PartBounds,
    choose_part_bytes,
    endpoint_of,
    link_for,
    part_bytes_for,
    tile_part_bytes,
)
from asynccache.download.ranges import read_range
from asynccache.download.retry import RetryPolicy
from asynccache.download.stats import DownloadStats
from asynccache.errors import ConfigError
from asynccache.storage import open_storage
from asynccache.testing.faults import FaultProxy

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


# -- the arithmetic ----------------------------------------------------------------------
def test_without_an_estimate_parts_fill_the_connections() -> None:
    kw = dict(concurrency=16, ttfb_s=None, bytes_per_s=None)
    # 4 chunks of 64 MiB make 32 parts of 8 MiB for 16 connections: the start stays.
    assert choose_part_bytes(8 * MiB, bytes_ahead=4 * 64 * MiB, **kw) == 8 * MiB
    # 4 chunks of 16 MiB would make 8 parts of 8 MiB: 4 MiB parts give each connection one.
    assert choose_part_bytes(8 * MiB, bytes_ahead=4 * 16 * MiB, **kw) == 4 * MiB
    # Never below the lower bound, however small the chunks.
    assert choose_part_bytes(8 * MiB, bytes_ahead=4 * MiB, **kw) == PartBounds().lo


def test_a_long_first_byte_wait_makes_parts_larger_up_to_the_fill() -> None:
    kw = dict(bytes_ahead=4 * 64 * MiB, concurrency=16)
    # 100 ms to the first byte at 100 MB/s wants 1 GB parts; with 8 chunks of 64 MiB
    # ahead, 16 MiB parts still make 32 for 16 connections, and larger would make fewer.
    big = dict(kw, bytes_ahead=8 * 64 * MiB)
    assert choose_part_bytes(8 * MiB, ttfb_s=0.1, bytes_per_s=100e6, **big) == 16 * MiB
    # With 4 chunks ahead the start already makes only that many: it stays.
    assert choose_part_bytes(8 * MiB, ttfb_s=0.1, bytes_per_s=100e6, **kw) == 8 * MiB
    # 50 ms at 8 MB/s: 8 MiB parts take 1 s, 21 first-byte waits: the start stays.
    assert choose_part_bytes(8 * MiB, ttfb_s=0.05, bytes_per_s=8e6, **kw) == 8 * MiB
    # A short wait on a fast connection (loopback) never shrinks parts below the start.
    assert choose_part_bytes(8 * MiB, ttfb_s=0.001, bytes_per_s=3e8, **kw) == 8 * MiB


sizes = st.integers(1, 1 << 34)
waits = st.none() | st.floats(0, 5, allow_nan=False)
rates = st.none() | st.floats(1, 1e11, allow_nan=False)


@given(
    start=st.integers(1, 1 << 30),
    ahead=sizes,
    conc=st.integers(1, 256),
    ttfb=waits,
    rate=rates,
)
def test_choice_is_bounded_aligned_and_keeps_both_rules(start, ahead, conc, ttfb, rate):
    b = PartBounds()
    part = choose_part_bytes(
        start,
        bytes_ahead=ahead,
        concurrency=conc,
        ttfb_s=ttfb,
        bytes_per_s=rate,
    )
    assert b.lo <= part <= b.hi and part % b.align == 0
    fill = ahead / conc
    up = b.align - 1  # aligned up: at most one alignment step above what a rule asks
    # Never larger than the start or the fill allows, unless the bounds force it.
    assert part <= max(b.lo, start + up, fill + up)
    if ttfb is not None and rate is not None:
        wanted = min(FIRST_BYTE_SHARE * ttfb * rate, max(start, fill / 2), b.hi)
        assert part > wanted - b.align  # the first-byte rule holds, to the alignment
    else:
        assert part <= max(b.lo, min(start, fill) + up)
        if b.lo <= fill <= min(start, b.hi):
            # The fill rule: the bytes ahead make no more parts than connections.
            assert -(-ahead // part) <= conc


@given(
    ahead=sizes,
    conc=st.integers(1, 256),
    ttfb=st.floats(0, 5, allow_nan=False),
    rate=st.floats(1, 1e11, allow_nan=False),
    more=st.floats(1, 100, allow_nan=False),
)
def test_choice_grows_with_the_wait_and_rate_and_shrinks_with_concurrency(
    ahead, conc, ttfb, rate, more
):
    def part(t: float, r: float, c: int) -> int:
        return choose_part_bytes(
            8 * MiB,
            bytes_ahead=ahead,
            concurrency=c,
            ttfb_s=t,
            bytes_per_s=r,
        )

    base = part(ttfb, rate, conc)
    assert part(ttfb * more, rate, conc) >= base
    assert part(ttfb, rate * more, conc) >= base
    assert part(ttfb, rate, conc * 2) <= base


def test_parts_are_tiled_to_the_connections() -> None:
    # 64 MiB in 10 MiB parts is 7 parts: two chunks on 14 of 16 connections. 8 MiB parts
    # run two chunks on all 16.
    assert tile_part_bytes(10 * MiB, 64 * MiB, 16) == 8 * MiB
    assert tile_part_bytes(10 * MiB, 67_016_767, 16) == 8 * MiB  # a chunk as written
    # 7 MiB parts make 10: one chunk at a time, 6 connections idle; 16 parts of 4 MiB.
    assert tile_part_bytes(7 * MiB, 64 * MiB, 16) == 4 * MiB
    # More parts than connections: a whole number of rounds (22 parts -> 32 of 2 MiB).
    assert tile_part_bytes(3 * MiB, 64 * MiB, 16) == 2 * MiB
    # Already tiled, one part, one connection, or nothing to split: unchanged.
    assert tile_part_bytes(8 * MiB, 64 * MiB, 16) == 8 * MiB
    assert tile_part_bytes(64 * MiB, 64 * MiB, 16) == 64 * MiB
    assert tile_part_bytes(10 * MiB, 64 * MiB, 1) == 10 * MiB
    assert tile_part_bytes(10 * MiB, 0, 16) == 10 * MiB
    # Never below the lower bound: 9 parts of 2 MiB stay 9, not 16 of 1.1 MiB.
    assert tile_part_bytes(2 * MiB, 17 * MiB, 16) == 2 * MiB


def _idle(parts: int, conc: int) -> int:
    """Connections idle while chunks of ``parts`` parts each run as the downloader starts
    them (whole chunks that fit together; past ``conc`` parts, the last round's gap)."""
    if parts <= conc:
        return conc - conc // parts * parts
    return -(-parts // conc) * conc - parts


@given(
    part=st.integers(1, 64).map(lambda m: m * MiB),
    size=st.integers(1, 1 << 31),
    conc=st.integers(1, 64),
)
def test_tiling_never_grows_a_part_nor_idles_more_connections(part, size, conc):
    b = PartBounds()
    tiled = tile_part_bytes(part, size, conc)
    assert tiled <= part and tiled % b.align == 0
    assert tiled >= min(part, b.lo)
    before, after = -(-size // part), -(-size // tiled)
    assert after >= before
    assert _idle(after, conc) <= _idle(before, conc)
    if before <= conc:  # the same number of chunks run together
        assert conc // after == conc // before


def test_bad_part_bounds_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="part bounds"):
        PartBounds(lo=4 * MiB, hi=2 * MiB)


def test_estimate_shrugs_off_stalls_and_forgets_old_samples() -> None:
    link = LinkEstimate("http://example")
    assert link.ttfb_s is None and link.bytes_per_s is None
    link.observe(0.001, 100, 0.001)  # a body too short to say anything of the rate
    assert link.ttfb_s == 0.001 and link.bytes_per_s is None
    for ttfb, seconds in ((0.02, 1.0), (0.03, 1.0), (0.025, 1.0), (5.0, 1.0), (4.0, 8.0)):
        link.observe(ttfb, 4 * MiB, seconds)
    # Two stalled requests (5 s to a first byte, 8 s for a body): the least wait and the
    # median rate stay with the link.
    assert link.ttfb_s == 0.001
    assert link.bytes_per_s == pytest.approx(4 * MiB)
    for _ in range(16):  # the link changed: the estimate follows it entirely
        link.observe(0.2, 8 * MiB, 0.5)
    assert link.ttfb_s == pytest.approx(0.2)
    assert link.bytes_per_s == pytest.approx(16 * MiB)
    assert link.observed == 22 and "observed=22" in repr(link)


def test_an_explicit_part_size_turns_adaptation_off() -> None:
    fast_start = LinkEstimate()
    for _ in range(3):
        fast_start.observe(0.5, 64 * MiB, 0.5)  # wants the largest parts there are
    kw = dict(bytes_ahead=8 * 256 * MiB)
    assert Settings.from_env({}).adaptive_parts is True
    assert part_bytes_for(Settings.from_env({}), fast_start, **kw) == 64 * MiB
    fixed = Settings.from_env({"ASYNCCACHE_PART_BYTES": "8MiB"})
    assert fixed.adaptive_parts is False
    assert part_bytes_for(fixed, fast_start, **kw) == 8 * MiB
    assert Settings.from_env({}, part_bytes=3 * MiB).adaptive_parts is False
    assert Settings.from_env({"ASYNCCACHE_ADAPTIVE_PARTS": "0"}).adaptive_parts is False
    both = {"ASYNCCACHE_PART_BYTES": "4MiB", "ASYNCCACHE_ADAPTIVE_PARTS": "on"}
    assert Settings.from_env(both).adaptive_parts is True  # 4 MiB is only the start
    with pytest.raises(ConfigError, match="ASYNCCACHE_ADAPTIVE_PARTS"):
        Settings.from_env({"ASYNCCACHE_ADAPTIVE_PARTS": "sometimes"})


# -- real downloads through the proxy -----------------------------------------------------
CHUNK = 6 * MiB  # 2 chunks ahead, 2 connections: fill = 6 MiB, start = lo = 2 MiB


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    src = tmp_path_factory.mktemp("link-src")
    return src, make_chunks(src, [CHUNK] * 4, seed=17)


def _fetch_together(dl: Downloader, chunks: dict, names: list[str]) -> None:
    """Hint ``names`` together, ask for each, and check every byte that arrived."""
    dl.hint(ChunkSpec(n, len(chunks[n][0]), chunks[n][1]) for n in names)
    futs = {n: dl.ensure(n, len(chunks[n][0]), chunks[n][1]) for n in names}
    for name, fut in futs.items():
        with open(fut.result(30), "rb") as f:
            assert f.read() == chunks[name][0], name


def _two_rounds(tmp_path, lt, url: str, chunks: dict) -> int:
    """Fetch chunks 0-1 together (nothing known of the link yet), then 2-3 (with what
    round one measured); every byte is checked. Returns the part size the estimate
    called for between the rounds (2 chunks ahead, 2 connections, starting at 2 MiB)."""
    settings = Settings.from_env(
        {},
        cache_dir=str(tmp_path / "cache"),
        max_concurrency=2,
        prefetch_chunks=2,
        part_bytes=2 * MiB,
        adaptive_parts=True,  # 2 MiB is where it starts
        retries=1,
        progress=False,
    )
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 30)
    dl = Downloader(storage, store, settings, loop_thread=lt)
    called_for = 0
    try:
        for names in (["chunk-0-0.bin", "chunk-0-1.bin"], ["chunk-0-2.bin", "chunk-0-3.bin"]):
            if not called_for and names[0] == "chunk-0-2.bin":
                called_for = part_bytes_for(settings, link_for(url), CHUNK * len(names))
            _fetch_together(dl, chunks, names)
    finally:
        dl.close()
    return called_for


def _parts_seen(proxy: FaultProxy) -> dict[str, int]:
    seen: dict[str, int] = {}
    for r in proxy.requests:
        if r.method == "GET" and r.range:
            name = r.path.rsplit("/", 1)[-1]
            seen[name] = seen.get(name, 0) + 1
    return seen


def _wanted(url: str) -> float:
    """The part size the first-byte rule alone asks of ``url``'s link."""
    link = link_for(url)
    assert link.ttfb_s is not None and link.bytes_per_s is not None
    return FIRST_BYTE_SHARE * link.ttfb_s * link.bytes_per_s


def test_part_size_follows_the_link(tmp_path, lt, http_origin, chunks) -> None:
    src, data = chunks
    origin = http_origin(src)
    # A slow start (150 ms to the first byte) on fast connections, and a prompt link of
    # slow connections (16 MB/s each), each behind a proxy of its own (its own endpoint).
    with (
        FaultProxy(origin.url, latency_s=0.15, conn_bytes_per_s=64_000_000) as slow_start,
        FaultProxy(origin.url, conn_bytes_per_s=16_000_000) as prompt,
    ):
        part_a = _two_rounds(tmp_path / "a", lt, slow_start.url, data)
        part_b = _two_rounds(tmp_path / "b", lt, prompt.url, data)
        assert slow_start.link_fired("latency") > 0 and slow_start.link_fired("cap") > 0
        assert prompt.link_fired("cap") > 0 and prompt.link_fired("latency") == 0
        a, b = _parts_seen(slow_start), _parts_seen(prompt)
    # Round one knew nothing of either link: 2 MiB parts, 3 per chunk, on both.
    for seen in (a, b):
        assert seen["chunk-0-0.bin"] == seen["chunk-0-1.bin"] == 3
    # Round two used what round one measured: the chunks went out in parts of that size.
    for seen, part in ((a, part_a), (b, part_b)):
        assert seen["chunk-0-2.bin"] == seen["chunk-0-3.bin"] == -(-CHUNK // part)
    # The slow start wants parts of 10 waits (96 MB at 64 MB/s): they stop at 3 MiB,
    # where the 2 chunks ahead still make twice as many parts as the 2 connections.
    assert part_a == 3 * MiB
    # The prompt link asks less of the first-byte rule, so never larger parts.
    assert link_for(slow_start.url).ttfb_s >= 0.15 > link_for(prompt.url).ttfb_s
    assert _wanted(slow_start.url) > _wanted(prompt.url) and part_b <= part_a
    # And straight from loopback: the bytes arrive intact, the estimate is this link's.
    _two_rounds(tmp_path / "c", lt, origin.url, data)
    direct = link_for(origin.url)
    assert direct.observed >= 6 and _wanted(origin.url) < _wanted(slow_start.url)


def test_a_chunk_goes_out_in_as_many_parts_as_connections(tmp_path, lt, http_origin) -> None:
    """12 MiB chunks, 4 connections, parts starting at 5 MiB: untiled, 3 parts (5, 5 and
    2 MiB) and one connection idle; tiled, 4 parts of 3 MiB, every connection busy."""
    src = tmp_path / "src"
    src.mkdir()
    data = make_chunks(src, [12 * MiB] * 2, seed=23)
    names = sorted(data)
    settings = Settings.from_env(
        {},
        cache_dir=str(tmp_path / "cache"),
        max_concurrency=4,
        prefetch_chunks=2,
        part_bytes=5 * MiB,
        adaptive_parts=True,
        retries=1,
        progress=False,
    )
    with FaultProxy(http_origin(src).url) as proxy:
        storage = open_storage(proxy.url, settings)
        lt.register_closer(storage.close)
        store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 30)
        dl = Downloader(storage, store, settings, loop_thread=lt)
        try:
            _fetch_together(dl, data, names)
            splits = dl.stats.splits
        finally:
            dl.close()
        ranges: dict[str, list[str]] = {}
        for r in proxy.requests:
            if r.method == "GET" and r.range:
                ranges.setdefault(r.path.rsplit("/", 1)[-1], []).append(r.range)
    part = 3 * MiB
    want = [f"bytes={i * part}-{(i + 1) * part - 1}" for i in range(4)]
    assert sorted(ranges) == names
    for name, got in ranges.items():
        assert all(w in got for w in want), (name, got)
    # On a busy machine a part that lags may have its back half split off to a request of
    # its own once the other parts have landed (a straggler split, counted): that one
    # lies inside a planned part, past its start. Nothing else goes out.
    extra = [(n, g) for n, got in ranges.items() for g in got if g not in want]
    assert len(extra) == splits, (extra, splits)
    for name, got in extra:
        a, b = (int(x) for x in got.removeprefix("bytes=").split("-"))
        assert a // part == b // part and a % part > 0, (name, got)


def test_endpoint_is_the_s3_endpoint_or_the_url_host() -> None:
    class S3Like:
        endpoint = "http://127.0.0.1:8333"
        url = "s3://bucket/prefix"

    class HttpLike:
        url = "https://host:8443/data/set"

    assert endpoint_of(S3Like()) == "http://127.0.0.1:8333"
    assert endpoint_of(HttpLike()) == "https://host:8443"
    assert link_for("https://host:8443") is link_for("https://host:8443")


def test_a_range_read_tells_the_link_its_first_byte_and_rate() -> None:
    """The first batches' range reads measure the link as a chunk's parts do: the main
    process of a DataLoader judges by them whether to start the workers' first chunks."""
    storage = DictStorage({"k": bytes(1 << 20)}, piece=1 << 16)
    storage.delay_s = 0.005  # before each piece: the first byte waits at least this
    link = LinkEstimate()

    @contextlib.asynccontextmanager
    async def slot():
        yield

    body = asyncio.run(
        read_range(
            storage,
            "k",
            0,
            1 << 20,
            policy=RetryPolicy(1, 0.01, 0.01),
            timeout_s=10,
            slot=slot,
            stats=DownloadStats(),
            link=link,
        )
    )
    assert len(body) == 1 << 20
    assert link.observed == 1
    assert link.ttfb_s is not None and link.ttfb_s >= 0.005
    assert link.bytes_per_s is not None
