"""An epoch's iterator dropped by its consumer (``break`` out of the loop, or ``del``)
stops its workers at once, without waiting for the garbage collector, and the loader's
state still counts the batches received.

Held in a reference cycle (loader -> epoch -> generator -> loader), the dropped iterator
lived until a collection, which could run first inside a worker forked for the next
epoch: that worker then ran the old iterator's shutdown (an AssertionError printed, and
the next epoch's first batch waited 10 s, two joins of 5 s)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from asynccache import CacheDataLoader, StreamingDataset
from tests.helpers import write_noise_dataset

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _children_gone(before: set[int], bound_s: float = 20.0) -> set[int]:
    """The child processes started since ``before`` that are still alive after waiting
    at most ``bound_s`` for them to exit."""
    deadline = time.monotonic() + bound_s
    while True:
        alive = {p.pid for p in mp.active_children()} - before
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_a_dropped_iterator_stops_its_workers_at_once(tmp_path: Path, no_gc, ctx) -> None:
    src = write_noise_dataset(tmp_path / "src", 64, 8, 256)
    ds = StreamingDataset(src, shuffle=True, seed=3)
    loader = CacheDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=ctx)
    before = {p.pid for p in mp.active_children()}
    started: set[int] = set()
    for n, _ in enumerate(loader, 1):
        if n == 3:
            started = {p.pid for p in mp.active_children()} - before
            break
    assert len(started) == 2, "the workers were not running at the break: proves nothing"
    assert _children_gone(before) == set(), "the dropped epoch's workers still run"
    state = loader.state_dict()
    assert state["batches"] == 3
    # The next epoch resumes after the three batches received.
    resumed = CacheDataLoader(StreamingDataset(src, shuffle=True, seed=3), batch_size=4)
    resumed.load_state_dict(state)
    rest = [int(i) for b in resumed for i in b["i"]]
    assert len(rest) == 64 - 12
    ds.close()


def test_iterators_dropped_one_after_another_each_stop_theirs(tmp_path: Path, no_gc) -> None:
    """One loader per seed, each left after its first batch (as a probe of first batches
    does): no epoch's workers outlive it, and no shutdown of an earlier one runs in a
    later one's workers."""
    src = write_noise_dataset(tmp_path / "src", 64, 8, 256)
    before = {p.pid for p in mp.active_children()}
    for seed in range(3):
        ds = StreamingDataset(src, shuffle=True, seed=seed)
        it = iter(CacheDataLoader(ds, batch_size=4, num_workers=2))
        next(it)
        del it
        assert _children_gone(before) == set(), seed
        ds.close()
