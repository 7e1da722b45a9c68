"""Every reader of a node picks the same shuffle window: it is fitted to the budget as it
stands at any moment (the setting, or the file system's size where that is smaller), not
to what is free when each process asks. Readers that fitted their windows to the free
space, which other files (and the cache itself) change from one moment to the next, read
different orders: samples repeated and missed across ranks.

The file system is faked here (its size and its free space), the dataset is real."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.cache import usage
from asynccache.read.readplan import EpochSpec, ReaderPlace, plan_minimum
from asynccache.sampling.order import OrderSpec
from tests.budget_data import write_remote

pytestmark = pytest.mark.timeout(120)

WINDOW, BATCH = 4, 8


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory):
    src = tmp_path_factory.mktemp("steady-src")
    return write_remote(objstore, str(src), f"steady-{uuid.uuid4().hex[:8]}", 600)


def _window(remote, objstore, cache: Path, budget: int) -> int:
    ds = StreamingDataset(
        remote.url,
        cache_dir=cache,
        shuffle=True,
        seed=2,
        shuffle_window=WINDOW,
        max_cache_bytes=budget,
        storage_options=objstore.storage_options,
    )
    dl = CacheDataLoader(ds, batch_size=BATCH, num_workers=0)
    next(iter(dl))
    window = ds._order().spec.window
    ds.close()
    return window


def test_readers_pick_one_window_whatever_is_free_when_each_asks(
    remote, objstore, tmp_path, monkeypatch
) -> None:
    place = ReaderPlace(0, (), 0, 1, 0, 1, 0, BATCH, False)
    full = plan_minimum(remote.index, EpochSpec(place, OrderSpec(2, True, WINDOW)), WINDOW)
    one = plan_minimum(remote.index, EpochSpec(place, OrderSpec(2, True, 1)), 1)
    assert one < full
    # A file system larger than the budget; one reader asks while it is nearly empty, the
    # next while other files leave only window 1's room free.
    monkeypatch.setattr(usage, "fs_capacity", lambda d: 4 * full)
    free = iter([4 * full] * 1000)
    monkeypatch.setattr(usage, "fs_room", lambda d: next(free))
    first = _window(remote, objstore, tmp_path / "a", full)
    free = iter([one] * 1000)
    second = _window(remote, objstore, tmp_path / "b", full)
    assert first == WINDOW
    assert second == first, "two readers of one node fitted different shuffle windows"


def test_a_file_system_smaller_than_the_budget_fits_the_window_to_its_size(
    remote, objstore, tmp_path, monkeypatch
) -> None:
    place = ReaderPlace(0, (), 0, 1, 0, 1, 0, BATCH, False)
    one = plan_minimum(remote.index, EpochSpec(place, OrderSpec(2, True, 1)), 1)
    monkeypatch.setattr(usage, "fs_capacity", lambda d: one)
    monkeypatch.setattr(usage, "fs_room", lambda d: one)
    assert _window(remote, objstore, tmp_path / "a", 100 * one) == 1
