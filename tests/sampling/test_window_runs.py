"""The read plan by windows (window_runs) against the plan by keys (reader_runs): the same
without shuffle, and with shuffle never less (each run by keys lies in a run by windows
of the same chunk), over subsample, wrapped epochs, padding and resumed segments."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.format.index import ChunkEntry, Index
from asynccache.read.readplan import EpochSpec, PlanCache, ReaderPlace
from asynccache.sampling.order import OrderSpec, ReadOrder
from asynccache.sampling.runs import reader_runs, reader_segments, window_runs


class SequentialUnits:
    """Items 0..N-1 stored in chunk order, as a sequential index holds them."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])

    @property
    def units_per_chunk(self) -> np.ndarray:
        return self.sizes

    def keys_of(self, chunk: int) -> np.ndarray:
        return np.arange(self.starts[chunk], self.starts[chunk + 1], dtype=np.int64)

    def chunks_of(self, keys: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, keys, side="right") - 1


def runs_of(r):
    return list(zip(r.chunks.tolist(), r.starts.tolist(), r.ends.tolist(), strict=True))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=14),
    shuffle=st.booleans(),
    window=st.integers(1, 4),
    subsample=st.sampled_from([None, 0.5]),
    wrap=st.sampled_from([None, 0.6, 1.7]),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    batch=st.integers(1, 4),
    drop_last=st.booleans(),
    received=st.integers(0, 6),
    seed=st.integers(0, 3),
)
def test_runs_by_windows_cover_runs_by_keys(
    sizes, shuffle, window, subsample, wrap, world, workers, batch, drop_last, received, seed
):
    units = SequentialUnits(sizes)
    probe = ReadOrder(units, OrderSpec(seed=seed, subsample=subsample), 0)
    epoch_size = None if wrap is None or probe.lap_size == 0 else int(probe.lap_size * wrap)
    spec = OrderSpec(
        seed=seed, shuffle=shuffle, window=window, subsample=subsample, epoch_size=epoch_size
    )
    order = ReadOrder(units, spec, 1)
    total = order.total
    remaining = [(0, total)] if total else []
    received = min(received, total)
    for segs in reader_segments(
        remaining,
        world=world,
        num_workers=workers,
        batch_size=batch,
        drop_last=drop_last,
        received=received - received % batch,
    ):
        by_keys = reader_runs(segs, order.keys, order.chunks_of, gap=order.gap)
        by_windows = window_runs(segs, order.spans, gap=order.gap)
        assert by_windows.length == by_keys.length
        if not shuffle:
            assert runs_of(by_windows) == runs_of(by_keys)
            continue
        # a stretch that ends inside a window takes all of the window's chunks
        assert set(by_windows.chunks.tolist()) >= set(by_keys.chunks.tolist())
        coarse = runs_of(by_windows)
        for c, a, b in runs_of(by_keys):
            assert any(c == cc and aa <= a and b <= bb for cc, aa, bb in coarse), (c, a, b)
        assert list(by_windows.starts) == sorted(by_windows.starts)


def test_a_plan_by_windows_of_a_large_shuffled_epoch_takes_arrays_only():
    # 200k chunks of 1,000 items: 200M positions, far past what a key per position costs.
    units = SequentialUnits([1000] * 200_000)
    order = ReadOrder(units, OrderSpec(seed=3, shuffle=True, window=4), 0)
    segs = reader_segments(
        [(0, order.total)], world=8, num_workers=4, batch_size=64, drop_last=False
    )
    runs = [window_runs(s, order.spans, gap=order.gap) for s in segs[:2]]
    assert [r.length for r in runs] == [sum(len(g) for g in s) for s in segs[:2]]
    # every chunk of reader 0's part is read in one run (its windows are whole)
    assert len(set(runs[0].chunks.tolist())) == len(runs[0].chunks)


def test_the_node_plan_takes_the_window_path_past_its_threshold():
    # PlanCache wiring: planned by windows (threshold lowered), a sequential index gives
    # the same plan as by keys unshuffled, and a plan never smaller shuffled.
    sizes = [7, 9, 0, 8, 6, 9, 5]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    chunks = tuple(
        ChunkEntry(f"chunk-0-{c}.bin", n, 100 + c, "xxh3_64:0", ((starts[c], n),) if n else ())
        for c, n in enumerate(sizes)
    )
    index = Index(chunks)
    for shuffle in (False, True):
        spec = EpochSpec(
            ReaderPlace(
                epoch=0,
                remaining=((0, sum(sizes)),),
                received=0,
                world=2,
                rank=0,
                num_workers=2,
                worker=0,
                batch_size=4,
                drop_last=False,
            ),
            OrderSpec(5, shuffle, 2),
        )
        by_keys, by_windows = PlanCache(index, spec), PlanCache(index, spec)
        by_windows.exact_up_to = -1
        a, b = by_keys(0, 0), by_windows(0, 0)
        assert a is not None and b is not None
        if not shuffle:
            assert [runs_of(s) for s in a.streams] == [runs_of(s) for s in b.streams]
        assert b.min_bytes >= a.min_bytes
