"""A reservation does not rescan the whole cache each time (issue 9, point 4)."""

from __future__ import annotations

import asyncio
import os

import pytest

from asynccache.cache import ChunkStore

pytestmark = pytest.mark.timeout(60)


def _count_cache_scans(monkeypatch, cache_dir) -> list[int]:
    """Count listings of ``cache_dir`` itself: each full scan starts with one."""
    calls = [0]
    scandir = os.scandir

    def counting(path=".", *args, **kwargs):
        if os.fspath(path) == os.fspath(cache_dir):
            calls[0] += 1
        return scandir(path, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", counting)
    return calls


def test_reservations_under_budget_rarely_scan(tmp_path, monkeypatch) -> None:
    n, size = 200, 1000
    store = ChunkStore(tmp_path / "cache" / "ds", max_cache_bytes=10 * n * size)
    scans = _count_cache_scans(monkeypatch, store.cache_dir)

    async def run() -> None:
        for i in range(n):
            tmp = await store.reserve(f"chunk-0-{i}.bin", size)
            tmp.pwrite(b"x" * size, 0)
            await asyncio.to_thread(tmp.publish)

    asyncio.run(run())
    assert scans[0] <= n // 20, f"{scans[0]} scans for {n} reservations"
    monkeypatch.undo()
    assert store.used_bytes() == n * size


def test_budget_still_holds_when_another_store_fills_the_cache(tmp_path) -> None:
    # Two stores are two processes' views: each trusts the shared ledger, not its own past.
    size, budget = 1000, 5000
    a = ChunkStore(tmp_path / "cache" / "a", max_cache_bytes=budget)
    b = ChunkStore(tmp_path / "cache" / "b", max_cache_bytes=budget)

    async def fill(store: ChunkStore, first: int) -> None:
        for i in range(first, first + 4):
            tmp = await store.reserve(f"chunk-0-{i}.bin", size)
            tmp.pwrite(b"x" * size, 0)
            await asyncio.to_thread(tmp.publish)
            assert store.used_bytes() <= budget

    asyncio.run(fill(a, 0))
    asyncio.run(fill(b, 10))
    asyncio.run(fill(a, 20))
    assert a.used_bytes() <= budget
