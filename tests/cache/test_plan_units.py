"""The node's read plan over units that may run into the next chunk (token blocks): a
reader's runs cover every chunk a unit touches, so reading one does not jump its place."""

from __future__ import annotations

import numpy as np

from asynccache.read.readplan import union_runs, whole_batches
from asynccache.sampling.partition import Segment
from asynccache.sampling.runs import ReaderRuns, reader_runs


def test_runs_of_start_and_last_chunks_are_joined():
    # 10 units; unit u starts in chunk u // 3 and the last unit of each chunk runs into
    # the next one
    starts = lambda u: np.asarray(u) // 3  # noqa: E731
    lasts = lambda u: np.minimum((np.asarray(u) + 1) // 3, 3)  # noqa: E731
    keys = lambda a, b: np.arange(a, b)  # noqa: E731
    segs = [Segment(0, 10)]
    a, b = reader_runs(segs, keys, starts), reader_runs(segs, keys, lasts)
    runs = union_runs(a, b)
    got = list(zip(runs.chunks.tolist(), runs.starts.tolist(), runs.ends.tolist(), strict=True))
    # chunk 1 is needed from position 2 (unit 2 runs into it) to 6, not from 3
    assert got == [(0, 0, 3), (1, 2, 6), (2, 5, 9), (3, 8, 10)]
    assert runs.length == 10
    assert union_runs(a, a).chunks.tolist() == a.chunks.tolist()


def test_whole_batches_widens_each_run_to_its_batches_and_merges_a_chunks_overlaps():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n, length, bs = int(rng.integers(1, 30)), 200, int(rng.integers(2, 20))
        starts = np.sort(rng.integers(0, length - 1, n))
        ends = np.minimum(starts + rng.integers(1, 30, n), length)
        runs = ReaderRuns(rng.integers(0, 6, n), starts, ends, length)
        got = whole_batches(runs, bs)
        # reference: per chunk, the positions covered by its widened runs
        want: dict[int, set[int]] = {}
        for c, s, e in zip(runs.chunks.tolist(), starts.tolist(), ends.tolist(), strict=True):
            a, b = s // bs * bs, min(-(-e // bs) * bs, length)
            want.setdefault(c, set()).update(range(a, b))
        have: dict[int, set[int]] = {}
        for c, s, e in zip(
            got.chunks.tolist(), got.starts.tolist(), got.ends.tolist(), strict=True
        ):
            assert not have.get(c, set()) & set(range(s, e)), "a chunk's runs overlap"
            have.setdefault(c, set()).update(range(s, e))
        assert have == want
        assert got.starts.tolist() == sorted(got.starts.tolist())
        assert got.length == length


def test_whole_batches_keep_the_chunks_of_a_batch_in_the_order_they_are_read():
    # A shuffled window's first batch reads chunks 14, 12, 0 and 11, in that order: the
    # widened runs all start at position 0, and the hint must still name 14 first.
    runs = ReaderRuns(
        np.array([14, 12, 0, 11, 3]),
        np.array([0, 1, 5, 9, 70]),
        np.array([60, 62, 63, 64, 90]),
        100,
    )
    got = whole_batches(runs, 64)
    assert got.chunks.tolist() == [14, 12, 0, 11, 3]
    assert got.starts.tolist() == [0, 0, 0, 0, 64]
    rng = np.random.default_rng(5)
    for _ in range(50):  # random runs: within a batch start, by first position read
        n, length, bs = int(rng.integers(1, 30)), 200, int(rng.integers(2, 20))
        starts = np.sort(rng.integers(0, length - 1, n))
        ends = np.minimum(starts + rng.integers(1, 30, n), length)
        chunks = rng.permutation(64)[:n]  # each chunk once: nothing merges
        got = whole_batches(ReaderRuns(chunks, starts, ends, length), bs)
        first = dict(zip(chunks.tolist(), starts.tolist(), strict=True))
        pairs = zip(got.chunks.tolist(), got.starts.tolist(), strict=True)
        keys = [(s, first[c]) for c, s in pairs]
        assert keys == sorted(keys)
