"""Waits are bounded by progress, not by totals (issue 9, C)."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from asynccache.bridge import LoopThread
from asynccache.cache import ChunkStore
from asynccache.config import Settings
from asynccache.download import Downloader
from asynccache.errors import RetriesExhaustedError, StorageTimeoutError
from asynccache.read.source import DatasetSource
from asynccache.storage import open_storage
from asynccache.testing.faults import Fault, FaultProxy
from tests.remote_data import write_dataset

pytestmark = pytest.mark.timeout(90)

CHUNK = "chunk-0-0.bin"


@pytest.fixture
def served(tmp_path, http_origin):
    # one chunk of about 50 KB
    src = write_dataset(tmp_path / "src", 10, chunk_size=10, pad=5000)
    return http_origin(src), os.path.getsize(src / CHUNK)


def _settings(tmp_path, **kw) -> Settings:
    base = dict(
        cache_dir=str(tmp_path / "cc"),
        retries=0,
        timeout_s=0.5,
        backoff_base_s=0.01,
        backoff_max_s=0.1,
        progress=False,
    )
    base.update(kw)
    return Settings(**base)


def _leftovers(cache: str) -> list[str]:
    return [f for _, _, files in os.walk(cache) for f in files if f.endswith(".tmp")]


def _lock_free(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_slow_but_steady_download_is_waited_for(served, tmp_path) -> None:
    server, size = served
    # 20 KB/s (above the floor) for ~2.5 s: longer than the old fixed total of
    # (timeout_s + backoff_max_s) * (retries + 2) = 1.2 s, yet never a stall.
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("trickle", path=CHUNK, bytes_per_s=20_000))
        with DatasetSource(proxy.url, settings=_settings(tmp_path)) as src:
            path = src.acquire(0)
            assert os.path.getsize(path) == size
            src.release(0)
        assert proxy.fired("trickle") == 1
        assert proxy.count("GET", CHUNK) == 1  # no retry either


def test_trickle_below_the_floor_is_a_stall(served, tmp_path) -> None:
    server, _ = served
    settings = _settings(tmp_path, min_bytes_per_s=4096)
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("trickle", times=10, path=CHUNK, bytes_per_s=1000))
        with DatasetSource(proxy.url, settings=settings) as src:
            with pytest.raises(RetriesExhaustedError, match="below ASYNCCACHE_MIN_BYTES_PER_S"):
                src.acquire(0)
            assert proxy.fired("trickle") == 1
            assert _leftovers(settings.cache_dir) == []
            assert _lock_free(src.downloader().store.lock_path(CHUNK))


def _downloader(tmp_path, lt, url, **kw) -> Downloader:
    settings = _settings(tmp_path, **kw)
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(tmp_path / "cc" / "ds", max_cache_bytes=1 << 30)
    return Downloader(storage, store, settings, loop_thread=lt)


def _in_flight(lt: LoopThread, dl: Downloader) -> int:
    async def count() -> int:
        return len(dl._inflight)

    return lt.call(count(), 5)


def _until(predicate, timeout: float = 10.0) -> bool:
    pause = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return True
        pause.wait(0.05)
    return predicate()


def _stalled(proxy: FaultProxy) -> bool:
    return proxy.fired("stall") == 1


def test_cancelled_waiter_cancels_its_download(served, tmp_path, lt) -> None:
    server, size = served
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("stall", path=CHUNK, after_bytes=1000, stall_s=60))
        dl = _downloader(tmp_path, lt, proxy.url, timeout_s=30)  # its own watchdog waits
        fut = dl.ensure(CHUNK, size)
        assert _until(lambda: _stalled(proxy))
        assert _in_flight(lt, dl) == 1 and _leftovers(str(tmp_path / "cc"))
        fut.cancel()  # the only caller gives up
        assert _until(lambda: _in_flight(lt, dl) == 0)
        assert _until(lambda: not _leftovers(str(tmp_path / "cc")))
        assert _lock_free(dl.store.lock_path(CHUNK))


def test_a_waiter_that_gives_up_on_a_stuck_download_cancels_it(served, tmp_path, lt) -> None:
    server, size = served
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("stall", path=CHUNK, after_bytes=1000, stall_s=60))
        dl = _downloader(tmp_path, lt, proxy.url, timeout_s=30)
        dl.stall_s = 1.0  # the waiter's bound, shorter than the download's own
        with pytest.raises(StorageTimeoutError, match="no progress"):
            dl.wait(dl.ensure(CHUNK, size), CHUNK)
        assert _stalled(proxy)
        assert _until(lambda: _in_flight(lt, dl) == 0)
        assert _until(lambda: not _leftovers(str(tmp_path / "cc")))
        assert _lock_free(dl.store.lock_path(CHUNK))


def test_download_goes_on_while_another_caller_wants_it(served, tmp_path, lt) -> None:
    server, size = served
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("slow", path=CHUNK, after_bytes=1000, stall_s=1.0))
        dl = _downloader(tmp_path, lt, proxy.url, timeout_s=30)
        first, second = dl.ensure(CHUNK, size), dl.ensure(CHUNK, size)
        assert _until(lambda: proxy.fired("slow") == 1)
        first.cancel()
        path = dl.wait(second, CHUNK)
        assert os.path.getsize(path) == size
        assert proxy.count("GET", CHUNK) == 1


def test_min_bytes_per_s_setting() -> None:
    from asynccache.errors import ConfigError

    assert Settings.from_env({"ASYNCCACHE_MIN_BYTES_PER_S": "8KiB"}).min_bytes_per_s == 8192
    assert Settings.from_env({"ASYNCCACHE_MIN_BYTES_PER_S": "0"}).min_bytes_per_s == 0
    with pytest.raises(ConfigError, match="ASYNCCACHE_MIN_BYTES_PER_S"):
        Settings.from_env({"ASYNCCACHE_MIN_BYTES_PER_S": "-1"})
