"""The next epoch's start under a budget (pure parts and the store on a local directory):
what a reader opens its next epoch with is never pushed out by a prefetch, a relative
cache dir still evicts by the plan, the window fitted to a budget, and the bounds the
budget tests assert."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from asynccache.cache.plan import Deferred, EpochPlan, cold_bound, warm_bound
from asynccache.cache.store import ChunkStore
from asynccache.config import Settings
from asynccache.errors import ConfigError
from asynccache.read.readplan import (
    EpochSpec,
    ReaderPlace,
    budget_bounds,
    fit_window,
    least_bytes,
    plan_minimum,
)
from asynccache.sampling.order import OrderSpec
from asynccache.write.writer import ChunkWriter, merge_dir
from tests.cache.test_plan import SIZE, policy, stream, two_readers


def in_order() -> EpochPlan:
    """Reader 0 reads chunks 0, 1, 2; reader 1 reads 3, 4, 5; 10 positions each."""
    return EpochPlan(
        [
            stream([(0, 0, 10), (1, 10, 20), (2, 20, 30)], 30),
            stream([(3, 0, 10), (4, 10, 20), (5, 20, 30)], 30),
        ],
        [SIZE] * 6,
    )


def test_the_opening_is_what_a_reader_holds_when_its_first_run_ends():
    plan = EpochPlan([stream([(0, 0, 10), (1, 8, 20), (2, 20, 30)], 30)], [SIZE] * 3)
    assert plan.opening(0).tolist() == [True, True, False]  # a batch straddles 0 and 1
    assert plan.closing().tolist() == [False, False, True]
    assert in_order().opening(1).nonzero()[0].tolist() == [3]


def test_a_prefetch_never_pushes_out_what_a_reader_opens_its_next_epoch_with():
    # Both readers near their ends: 0, 1, 3, 4 are consumed. Next epoch reader 0 opens
    # with chunk 0 and reader 1 with chunk 3: a prefetch may push out 1 and 4 only; a
    # reader's own download takes them last among the consumed (Belady: read soonest).
    p = policy(in_order(), [(0, 0, 25), (0, 0, 25)])
    names = [f"chunk-0-{i}.bin" for i in (0, 1, 3, 4)]
    assert p.spare(names) == ["chunk-0-1.bin", "chunk-0-4.bin"]
    assert set(p.victims(names, {})[-2:]) == {"chunk-0-0.bin", "chunk-0-3.bin"}


def test_the_store_defers_a_prefetch_rather_than_push_out_a_next_epoch_opening(tmp_path):
    settings = Settings.from_env(cache_dir=str(tmp_path), max_cache_bytes=3 * SIZE)
    store = ChunkStore.for_dataset(settings, "s3://bucket/ds", "id", durable=False)
    for i in (0, 3, 2):  # 0, 3: the readers' openings next epoch; 2: read now
        publish(store, i)
    store.policy = policy(in_order(), [(0, 0, 25), (0, 0, 25)])
    with pytest.raises(Deferred):
        asyncio.run(store.reserve("chunk-0-5.bin", SIZE, ahead=True))
    assert {"chunk-0-0.bin", "chunk-0-2.bin", "chunk-0-3.bin"} <= set(os.listdir(store.root))


def publish(store: ChunkStore, i: int) -> None:
    tmp = store.create_temp(f"chunk-0-{i}.bin", SIZE)
    os.pwrite(tmp.fd, b"x" * SIZE, 0)
    tmp.publish()


@pytest.mark.parametrize("how", ["relative", "dotdot"])
def test_a_relative_cache_dir_evicts_by_the_plan_not_by_recency(tmp_path, monkeypatch, how):
    # A cache dir given relative to the working directory (or through "..") named this
    # dataset's chunks otherwise than the scans do: none was taken for this dataset's,
    # and the plan never ordered an eviction (plain LRU: the next epoch started cold).
    monkeypatch.chdir(tmp_path)
    os.makedirs("work")
    cache = "cache" if how == "relative" else os.path.join("work", "..", "cache")
    settings = Settings.from_env(cache_dir=cache, max_cache_bytes=3 * SIZE)
    store = ChunkStore.for_dataset(settings, "s3://bucket/ds", "id", durable=False)
    assert store.root.is_absolute() and ".." not in store.root.parts
    for age, i in enumerate((0, 3, 1)):  # by recency chunk 0 goes first
        publish(store, i)
        os.utime(store.path(f"chunk-0-{i}.bin"), (1000 + age, 1000 + age))
    store.policy = policy(in_order(), [(0, 0, 25), (0, 0, 25)])
    tmp = asyncio.run(store.reserve("chunk-0-2.bin", SIZE))  # a reader waits for it
    tmp.discard()
    left = set(os.listdir(store.root))
    assert {"chunk-0-0.bin", "chunk-0-3.bin"} <= left, "an opening of the next epoch went"
    assert "chunk-0-1.bin" not in left


def test_the_warm_bound_is_the_target_unless_the_boundary_is_larger():
    # Two readers of 10 chunks each: the boundary is 4 chunks (each reader's last as the
    # epoch ends, its first as the next one starts), and one chunk of slack.
    plan = EpochPlan(
        [stream([(r * 10 + c, 10 * c, 10 * c + 10) for c in range(10)], 100) for r in (0, 1)],
        [SIZE] * 20,
    )
    assert warm_bound(plan, plan, 10 * SIZE) == 10 * SIZE + (4 + 1) * SIZE  # > 1.1 x 10
    assert warm_bound(plan, plan, 20 * SIZE) == 0
    assert warm_bound(plan, plan, 3 * SIZE) == 20 * SIZE  # never more than the dataset
    many = EpochPlan([stream([(c, 10 * c, 10 * c + 10) for c in range(100)], 1000)], [SIZE] * 100)
    assert warm_bound(many, many, 50 * SIZE) == int(1.1 * 50 * SIZE)
    assert cold_bound(plan, plan.min_bytes) == 20 * SIZE
    shared = two_readers()
    assert cold_bound(shared, shared.min_bytes - 1) == 6 * SIZE + SIZE  # chunk 5 twice


def index_of(tmp_path, chunks: int, per: int = 8):
    src = str(tmp_path / "src")
    w = ChunkWriter(src, 0, chunk_bytes=per * 120)
    for i in range(chunks * per):
        w.add(i, {"i": i, "x": np.zeros(100, np.uint8)})
    w.finish()
    return merge_dir(src, [0])


def spec_of(workers: int, window: int, batch: int = 4) -> EpochSpec:
    place = ReaderPlace(
        epoch=0,
        remaining=(),
        received=0,
        world=1,
        rank=0,
        num_workers=workers,
        worker=0,
        batch_size=batch,
        drop_last=False,
    )
    return EpochSpec(place, OrderSpec(7, True, window))


def test_the_window_shrinks_to_the_largest_whose_plan_fits_and_no_further(tmp_path):
    index = index_of(tmp_path, 40)
    chunk = int(index.bytes_per_chunk.max())
    spec = spec_of(2, 8)
    mins = {w: plan_minimum(index, spec, w) for w in range(1, 9)}
    assert mins[1] < mins[8]
    full = fit_window("u", index, spec, mins[8])
    assert (full.window, full.shrunk) == (8, False)
    least = least_bytes(index, 2)
    for budget in sorted({mins[8] - 1, *mins.values(), mins[3] - 1, least}):
        if budget < least:
            continue
        got = fit_window("u", index, spec, budget)
        best = max([w for w in range(1, 9) if mins[w] <= budget], default=1)
        assert got.window == best, (budget // chunk, {w: m // chunk for w, m in mins.items()})
        assert got.needs == mins[best] and got.needed == mins[8]
        assert fit_window("u", index, spec, budget) == got  # the same answer everywhere
        if got.shrunk:
            assert f"shuffle_window {got.window}" in got.why(2)


def test_a_budget_of_two_chunks_per_reader_runs_and_one_below_is_refused(tmp_path):
    index = index_of(tmp_path, 40)
    least = least_bytes(index, 4)
    assert least == 2 * 4 * int(index.bytes_per_chunk.max())
    got = fit_window("u", index, spec_of(4, 4, batch=3), least)
    assert got.window == 1 and got.needs > least  # below the plan's minimum even at 1
    assert "fetched more than once" in got.why(4)
    with pytest.raises(ConfigError, match=rf"below the minimum of {least} bytes .* 4 readers"):
        fit_window("u", index, spec_of(4, 4, batch=3), least - 1)
    cold, _ = budget_bounds(index, spec_of(4, 1, batch=3), least)
    assert cold > int(index.bytes_per_chunk.sum())  # shared chunks may come twice
