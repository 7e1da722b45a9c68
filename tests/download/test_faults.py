"""Real servers, real faults: every chunk arrives byte-identical, or a clear error, never a hang."""

from __future__ import annotations

import dataclasses
import time

import pytest
from dl_support import make_chunks

from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import Downloader
from asynccache.errors import (
    ChecksumMismatchError,
    DatasetRewrittenError,
    ObjectNotFoundError,
    RetriesExhaustedError,
)
from asynccache.storage import open_storage
from asynccache.testing.faults import Fault, FaultProxy

pytestmark = pytest.mark.timeout(60)

SIZE = 600_000


def _settings(tmp_path, **kw) -> Settings:
    base = dict(
        cache_dir=str(tmp_path / "cache"),
        retries=3,
        backoff_base_s=0.01,
        backoff_max_s=1.0,
        timeout_s=1.0,
        part_bytes=256 << 10,
        max_concurrency=4,
    )
    base.update(kw)
    return Settings(**base)


@pytest.fixture
def origin(tmp_path, http_origin):
    src = tmp_path / "src"
    src.mkdir()
    chunks = make_chunks(src, [SIZE, 1000])
    return http_origin(src), chunks


def _fetch(tmp_path, lt, url, chunks, name="chunk-0-0.bin", **kw):
    settings = _settings(tmp_path, **kw)
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 30)
    dl = Downloader(storage, store, settings, loop_thread=lt)
    data, checksum = chunks[name]
    try:
        path = dl.ensure(name, len(data), checksum).result(30)
    finally:
        dl.close()
    with open(path, "rb") as f:
        assert f.read() == data
    return dl


FAULTS = {
    "5xx burst": (Fault("status", times=3, status=503), 4),
    "429 retry-after": (Fault("status", status=429, retry_after=0.3), 2),
    "reset mid-body": (Fault("reset", after_bytes=100_000), 2),
    "truncated body": (Fault("truncate", after_bytes=100_000), 2),
    "stall": (Fault("stall", after_bytes=50_000, stall_s=30), 2),
    "flipped byte": (Fault("flip", flip_at=1234), 2),
}


@pytest.mark.parametrize("case", list(FAULTS))
def test_fault_recovered_byte_identical(tmp_path, lt, origin, case) -> None:
    server, chunks = origin
    template, expected_gets = FAULTS[case]
    fault = dataclasses.replace(template)
    fault.path = "chunk-0-0.bin"
    fault.methods = ("GET",)
    with FaultProxy(server.url) as proxy:
        # one part (no ranged split) so GETs are easy to count
        proxy.add_fault(fault)
        t0 = time.monotonic()
        dl = _fetch(tmp_path, lt, proxy.url, chunks, part_bytes=1 << 20)
        elapsed = time.monotonic() - t0
        assert proxy.count("GET", "chunk-0-0.bin") == expected_gets
        assert proxy.fired(fault.kind) == template.times  # each programmed fault took effect
        assert dl.stats.retries == expected_gets - 1
        if case == "429 retry-after":
            assert elapsed >= 0.3
        if case in ("reset mid-body", "truncated body", "stall"):
            ranges = [r.range for r in proxy.requests if r.method == "GET"]
            start = int(ranges[1].split("=")[1].split("-")[0])
            # resumed from what arrived (the client may drop its last partial read)
            assert 0 < start <= fault.after_bytes
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "cache" / "ds").iterdir())


def test_faults_on_ranged_parts(tmp_path, lt, origin) -> None:
    server, chunks = origin
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("reset", times=2, after_bytes=10_000, path="chunk-0-0"))
        proxy.add_fault(Fault("status", times=2, status=500, path="chunk-0-0"))
        _fetch(tmp_path, lt, proxy.url, chunks, part_bytes=128 << 10)
        assert proxy.fired("reset") == 2 and proxy.fired("status") == 2


def test_retry_budget_exhausted_is_a_clear_error(tmp_path, lt, origin) -> None:
    server, chunks = origin
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("status", times=100, status=500))  # a fault, not throttling
        t0 = time.monotonic()
        with pytest.raises(RetriesExhaustedError) as info:
            _fetch(tmp_path, lt, proxy.url, chunks, retries=2, part_bytes=1 << 20)
        assert time.monotonic() - t0 < 10
        assert proxy.url in str(info.value) and "3 attempts" in str(info.value)
        assert "500" in str(info.value)
        assert proxy.fired("status") == 3
    assert not any((tmp_path / "cache" / "ds").glob("chunk-*"))


def test_stall_every_time_times_out_in_bounded_time(tmp_path, lt, origin) -> None:
    server, chunks = origin
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("stall", times=100, after_bytes=1000, stall_s=60))
        t0 = time.monotonic()
        with pytest.raises(RetriesExhaustedError, match="stalled"):
            _fetch(tmp_path, lt, proxy.url, chunks, retries=1, timeout_s=0.3)
        assert time.monotonic() - t0 < 10
        assert proxy.fired("stall") == proxy.count("GET") > 0  # every attempt stalled


def test_corruption_every_time_is_a_checksum_error(tmp_path, lt, origin) -> None:
    server, chunks = origin
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", times=100, flip_at=7))
        with pytest.raises(ChecksumMismatchError, match=r"chunk-0-1\.bin") as info:
            _fetch(tmp_path, lt, proxy.url, chunks, name="chunk-0-1.bin", retries=2)
        assert not isinstance(info.value, DatasetRewrittenError)  # size, ETag unchanged
        assert "3 downloads in a row" in str(info.value)
        assert proxy.count("GET") == 3  # the retry budget: retries=2
        assert proxy.fired("flip") == 3


def test_missing_object_is_not_retried(tmp_path, lt, origin) -> None:
    server, chunks = origin
    chunks = {"nope.bin": (b"x", None)}
    with FaultProxy(server.url) as proxy:
        with pytest.raises(ObjectNotFoundError):
            _fetch(tmp_path, lt, proxy.url, chunks, name="nope.bin")
        assert proxy.count("GET") == 1


@pytest.mark.slow
def test_s3_through_the_proxy_keeps_sigv4_valid(tmp_path, lt, objstore, bucket) -> None:
    src = tmp_path / "src"
    src.mkdir()
    chunks = make_chunks(src, [SIZE])
    settings = _settings(tmp_path, timeout_s=20)  # the first write allocates a volume
    upstream = open_storage(f"s3://{bucket}/ds", settings, objstore.storage_options)
    lt.register_closer(upstream.close)
    lt.call(upstream.upload(src / "chunk-0-0.bin", "chunk-0-0.bin"), 30)
    with FaultProxy(objstore.endpoint_url) as proxy:
        proxy.add_fault(Fault("reset", after_bytes=50_000, path="chunk-0-0"))
        proxy.add_fault(Fault("status", status=503, path="chunk-0-0"))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        storage = open_storage(f"s3://{bucket}/ds", settings, options)
        lt.register_closer(storage.close)
        store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 30)
        dl = Downloader(storage, store, settings, loop_thread=lt)
        data, checksum = chunks["chunk-0-0.bin"]
        path = dl.ensure("chunk-0-0.bin", len(data), checksum).result(30)
        with open(path, "rb") as f:
            assert f.read() == data
        assert proxy.count("GET", "chunk-0-0.bin") >= 4
        assert proxy.fired("reset") == 1 and proxy.fired("status") == 1
