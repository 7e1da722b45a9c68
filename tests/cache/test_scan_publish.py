"""A chunk published while a scan lists its directory is counted (its temporary name
listed, gone by the time the scan looks at it): a scan that missed it let the cache go
one chunk over its budget, and stay there."""

from __future__ import annotations

import asyncio
import os

import pytest

from asynccache.cache import ChunkStore, usage

pytestmark = pytest.mark.timeout(60)

SIZE = 1000


class _PublishAfterListing:
    """``os.scandir`` of ``root`` that runs ``then`` once its entries are listed, before
    the caller looks at any of them (a publish landing in that gap)."""

    def __init__(self, monkeypatch, root, then) -> None:
        self.root, self.then, self.fired = os.fspath(root), then, 0
        self.scandir = os.scandir
        monkeypatch.setattr(os, "scandir", self)

    def __call__(self, path=".", *args, **kwargs):
        it = self.scandir(path, *args, **kwargs)
        if os.fspath(path) != self.root or self.fired:
            return it
        with it:
            listed = list(it)
        self.fired += 1
        self.then()
        return _Listed(listed)


class _Listed(list):
    def __enter__(self):
        return iter(self)

    def __exit__(self, *exc) -> None:
        return None


async def _filled(store: ChunkStore, name: str):
    tmp = await store.reserve(name, SIZE)
    tmp.pwrite(b"x" * SIZE, 0)
    return tmp


def test_a_scan_counts_a_chunk_published_after_its_listing(tmp_path, monkeypatch) -> None:
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=10 * SIZE)
    tmp = asyncio.run(_filled(store, "chunk-0-0.bin"))
    race = _PublishAfterListing(monkeypatch, store.root, tmp.publish)
    used, entries = usage.scan(store.cache_dir, store.root)
    monkeypatch.undo()
    assert race.fired == 1
    assert store.path("chunk-0-0.bin").exists()
    assert used == SIZE
    assert [os.path.basename(e.key) for e in entries] == ["chunk-0-0.bin"]


def test_the_budget_holds_when_a_chunk_is_published_during_an_evictions_scan(
    tmp_path, monkeypatch
) -> None:
    budget = 3 * SIZE
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=budget)

    async def run() -> None:
        for i in range(2):
            (await _filled(store, f"chunk-0-{i}.bin")).publish()
        third = await _filled(store, "chunk-0-2.bin")  # the budget now full
        # The fourth must evict; the third is published while that eviction's scan lists.
        race = _PublishAfterListing(monkeypatch, store.root, third.publish)
        fourth = await store.reserve("chunk-0-3.bin", SIZE)
        monkeypatch.undo()
        assert race.fired == 1
        fourth.pwrite(b"x" * SIZE, 0)
        fourth.publish()

    asyncio.run(run())
    on_disk = sorted(p.name for p in store.root.glob("chunk-*.bin"))
    assert len(on_disk) * SIZE <= budget, on_disk
    assert "chunk-0-3.bin" in on_disk
    assert store.used_bytes() <= budget
