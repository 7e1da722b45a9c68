"""A chunk evicted by another process between its download and the pin taken for its
reader (:meth:`.ChunkStore.hand_over`, as the I/O thread answers the reader) is fetched
again, after a short, growing pause, until ``_PIN_RETRY_S`` has passed; only then does the
reader get :class:`TransientError` (asynccache.read.source.DatasetSource.acquire). Once
handed over, no evictor takes it before the reader's own pin, however late that comes.

Real HTTP origin, real downloader and cache; the eviction is the store's own (the file
unlinked under the exclusive lock, as another process's evictor does).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asynccache.cache import store as store_module
from asynccache.cache.store import ChunkStore
from asynccache.config import Settings
from asynccache.errors import TransientError
from asynccache.read import source as source_module
from asynccache.read.source import DatasetSource
from asynccache.testing.httpserver import StaticHTTPServer
from tests.helpers import write_noise_dataset

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def origin(tmp_path_factory) -> Iterator[StaticHTTPServer]:
    src = write_noise_dataset(tmp_path_factory.mktemp("src") / "data", 8, 4, 4096)
    with StaticHTTPServer(src) as server:
        yield server


def _settings(cache: Path) -> Settings:
    return Settings(cache_dir=str(cache), retries=1, timeout_s=10.0, prefetch_chunks=0)


class Evictor:
    """Tries to evict chunk ``name`` right before each of the first ``times`` calls of
    ``ChunkStore.<where>`` for it: ``hand_over`` (the I/O thread's pin for the reader) or
    ``pin`` (the reader's own)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, name: str, times: int, where: str = "hand_over"
    ) -> None:
        self.name, self.left, self.evicted, self.pins = name, times, 0, 0
        real = getattr(ChunkStore, where)

        def pin(store: ChunkStore, name: str) -> object:
            if name == self.name:
                self.pins += 1
                if self.left:
                    self.left -= 1
                    if store_module._remove_if_unlocked(str(store.path(name))):
                        self.evicted += 1
            return real(store, name)

        monkeypatch.setattr(ChunkStore, where, pin)


def _gets(origin: StaticHTTPServer, name: str) -> int:
    return sum(1 for r in origin.requests if r.method == "GET" and r.path.endswith(name))


def test_a_chunk_evicted_before_its_pin_is_fetched_again(tmp_path, origin, monkeypatch):
    with DatasetSource(origin.url, settings=_settings(tmp_path / "cache")) as src:
        name = src.index.chunks[0].filename
        before = _gets(origin, name)
        ev = Evictor(monkeypatch, name, times=12)  # more rounds than the old fixed 8
        path = src.acquire(0)
        try:
            assert ev.evicted == 12, "every eviction fired"
            assert ev.pins == 13 and _gets(origin, name) - before == 13
            assert Path(path).stat().st_size == src.index.chunks[0].bytes
        finally:
            src.release(0)


def test_a_chunk_evicted_every_time_gives_up_after_the_bound(tmp_path, origin, monkeypatch):
    monkeypatch.setattr(source_module, "_PIN_RETRY_S", 0.3)
    with DatasetSource(origin.url, settings=_settings(tmp_path / "cache")) as src:
        name = src.index.chunks[1].filename
        ev = Evictor(monkeypatch, name, times=10**6)
        t = time.monotonic()
        with pytest.raises(TransientError, match="evicted again right after download"):
            src.acquire(1)
        took = time.monotonic() - t
        assert ev.evicted == ev.pins >= 3, "fetched again, each time evicted"
        assert took >= 0.3 - source_module._PIN_PAUSE_S[1], "waited out the bound"


def test_a_chunk_handed_over_is_never_evicted_before_the_readers_pin(tmp_path, origin, monkeypatch):
    """The reader's thread pins after the I/O thread answered it; an evictor between the
    two finds the chunk pinned for the reader (it tried: counted), and nothing is fetched
    twice."""
    with DatasetSource(origin.url, settings=_settings(tmp_path / "cache")) as src:
        name = src.index.chunks[0].filename
        before = _gets(origin, name)
        ev = Evictor(monkeypatch, name, times=1, where="pin")
        path = src.acquire(0)
        try:
            assert ev.pins == 1 and ev.left == 0, "the evictor tried"
            assert ev.evicted == 0, "handed over: pinned"
            assert _gets(origin, name) - before == 1
            assert Path(path).stat().st_size == src.index.chunks[0].bytes
        finally:
            src.release(0)
        dl = src.downloader()
        assert dl.wait_published(10)
        assert dl.store.pinned() == {}, "the reader's release let go of the hand-over"
