"""The fault proxy in front of the cloud emulators and the Hub: each recovers byte-identical.

The proxy forwards requests unchanged (signatures and tokens stay valid) and injects a
429 with ``Retry-After``, a 503 burst and a reset mid-body; the downloader must retry,
honour the server's delay, resume from what arrived and publish the exact bytes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from asynccache.bridge import LoopThread
from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import Downloader
from asynccache.errors import RetriesExhaustedError, ThrottleTimeoutError
from asynccache.storage import open_storage
from asynccache.testing.faults import Fault, FaultProxy

pytestmark = pytest.mark.timeout(60)

SIZE = 600_000
NAME = "chunk-0-0.bin"


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.close()


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = dict(
        cache_dir=str(tmp_path / "cache"),
        retries=3,
        backoff_base_s=0.01,
        backoff_max_s=1.0,
        timeout_s=2.0,
        part_bytes=256 << 10,
        max_concurrency=4,
    )
    base.update(kw)
    return Settings(**base)


def _cloud(request: pytest.FixtureRequest, kind: str) -> tuple[str, str, dict[str, Any]]:
    """``(url, endpoint, options)`` of a fresh, empty dataset root on ``kind``'s emulator."""
    if kind == "gs":
        emulator = request.getfixturevalue("gcs_emulator")
        bucket = request.getfixturevalue("gcs_bucket")
        return f"gs://{bucket}/ds", emulator.endpoint_url, dict(emulator.storage_options)
    azurite = request.getfixturevalue("azurite")
    container = request.getfixturevalue("az_container")
    return f"az://{container}/ds", f"http://127.0.0.1:{azurite.port}", dict(azurite.storage_options)


def _with_endpoint(kind: str, options: dict[str, Any], endpoint: str) -> dict[str, Any]:
    return (
        dict(options, endpoint_url=endpoint)
        if kind == "gs"
        else dict(options, endpoint_url=endpoint + "/" + options["account_name"])
    )


@pytest.fixture(params=["gs", "az"])
def seeded(request: pytest.FixtureRequest, tmp_path: Path, lt: LoopThread):
    kind = request.param
    url, endpoint, options = _cloud(request, kind)
    data = random.Random(7).randbytes(SIZE)
    (tmp_path / NAME).write_bytes(data)
    settings = _settings(tmp_path)
    upstream = open_storage(url, settings, options)
    lt.register_closer(upstream.close)
    lt.call(upstream.upload(tmp_path / NAME, NAME), 30)
    return kind, url, endpoint, options, data


def _fetch(
    tmp_path: Path, lt: LoopThread, url: str, options: dict[str, Any], data: bytes, **kw: Any
) -> Downloader:
    settings = _settings(tmp_path, **kw)
    storage = open_storage(url, settings, options)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=1 << 30)
    dl = Downloader(storage, store, settings, loop_thread=lt)
    try:
        path = dl.ensure(NAME, len(data), xxhash.xxh3_64(data).hexdigest()).result(30)
    finally:
        dl.close()
    assert Path(path).read_bytes() == data
    return dl


def test_throttling_and_reset_recovered(tmp_path: Path, lt: LoopThread, seeded) -> None:
    kind, url, endpoint, options, data = seeded
    with FaultProxy(endpoint) as proxy:
        proxy.add_fault(Fault("status", status=429, retry_after=0.3, path=NAME))
        proxy.add_fault(Fault("status", times=2, status=503, path=NAME))
        proxy.add_fault(Fault("reset", after_bytes=50_000, path=NAME))
        t0 = time.monotonic()
        dl = _fetch(
            tmp_path,
            lt,
            url,
            _with_endpoint(kind, options, proxy.url),
            data,
            part_bytes=1 << 20,
            retries=5,
        )
        elapsed = time.monotonic() - t0
        assert proxy.fired("status") == 3 and proxy.fired("reset") == 1
        assert proxy.count("GET", NAME) == 5
        assert dl.stats.retries == 4
        assert elapsed >= 0.3  # the service's Retry-After was honoured
        ranges = [r.range for r in proxy.requests if r.method == "GET" and NAME in r.path]
        start = int(str(ranges[-1]).split("=")[1].split("-")[0])
        assert 0 < start <= 50_000  # resumed from what arrived


def test_ranged_parts_in_parallel_survive_faults(tmp_path: Path, lt: LoopThread, seeded) -> None:
    kind, url, endpoint, options, data = seeded
    with FaultProxy(endpoint) as proxy:
        proxy.add_fault(Fault("reset", times=2, after_bytes=10_000, path=NAME))
        proxy.add_fault(Fault("status", times=2, status=500, path=NAME))
        _fetch(
            tmp_path, lt, url, _with_endpoint(kind, options, proxy.url), data, part_bytes=128 << 10
        )
        assert proxy.fired("reset") == 2 and proxy.fired("status") == 2
        ranged = {r.range for r in proxy.requests if r.method == "GET" and NAME in r.path}
        assert len(ranged) >= 5  # 600 kB in 128 KiB parts: at least five distinct ranges


def test_throttled_forever_is_a_clear_error(tmp_path: Path, lt: LoopThread, seeded) -> None:
    kind, url, endpoint, options, data = seeded
    with FaultProxy(endpoint) as proxy:
        proxy.add_fault(Fault("status", times=1000, status=503, path=NAME))
        with pytest.raises(ThrottleTimeoutError) as info:
            _fetch(
                tmp_path,
                lt,
                url,
                _with_endpoint(kind, options, proxy.url),
                data,
                retries=1,
                throttle_patience_s=0.5,
                part_bytes=1 << 20,
            )
        assert "503" in str(info.value) and f"{url}/{NAME}" in str(info.value)
        assert "ASYNCCACHE_THROTTLE_PATIENCE_S" in str(info.value)
        assert proxy.fired("status") > 2  # throttling is not counted against the retries


def test_failing_forever_is_a_clear_error(tmp_path: Path, lt: LoopThread, seeded) -> None:
    kind, url, endpoint, options, data = seeded
    with FaultProxy(endpoint) as proxy:
        proxy.add_fault(Fault("status", times=100, status=500, path=NAME))
        with pytest.raises(RetriesExhaustedError) as info:
            _fetch(
                tmp_path,
                lt,
                url,
                _with_endpoint(kind, options, proxy.url),
                data,
                retries=1,
                part_bytes=1 << 20,
            )
        assert "500" in str(info.value) and f"{url}/{NAME}" in str(info.value)
        # Two downloads (ranged GETs); GCS's metadata GET after them (did the object
        # change?) meets the fault too.
        assert len([r for r in proxy.requests if r.range and r.fault]) == 2


def test_hub_throttling_is_retried_and_the_token_stays_on_the_hub(
    tmp_path: Path, lt: LoopThread, hub
) -> None:
    data = random.Random(9).randbytes(SIZE)
    hub.token = "hf_" + "k" * 30
    hub.commit("org/ds", {NAME: data}, private=True)
    with FaultProxy(hub.url) as proxy:
        proxy.add_fault(
            Fault("status", status=429, retry_after=0.3, path="resolve", methods=("HEAD", "GET"))
        )
        proxy.add_fault(Fault("status", status=503, path="resolve", methods=("HEAD", "GET")))
        options = {"endpoint_url": proxy.url, "token": hub.token}
        t0 = time.monotonic()
        dl = _fetch(tmp_path, lt, "hf://datasets/org/ds", options, data, part_bytes=128 << 10)
        assert time.monotonic() - t0 >= 0.3  # the Hub's Retry-After was honoured
        assert proxy.fired("status") == 2 and dl.stats.retries >= 2
    assert all(r.headers.get("Authorization") == f"Bearer {hub.token}" for r in hub.hub_requests)
    assert hub.cdn_requests and all("Authorization" not in r.headers for r in hub.cdn_requests)
    assert len([r for r in hub.cdn_requests if r.headers.get("Range")]) >= 5  # ranged parts
