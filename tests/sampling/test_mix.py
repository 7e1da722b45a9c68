"""The mixed epoch's deal (pure): proportions, pure and stratified batches, the mapping to
each stream's own order, and the epoch order's subsample and epoch_size."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.sampling.mix import MixOrder, Share, apportion, stream_counts
from asynccache.sampling.order import EpochOrder, OrderSpec, ReadOrder, subsample_chunks

WEIGHTS = np.array([0.5, 0.3, 0.2])


def test_random_mix_proportions_over_50k_samples():
    counts = stream_counts(
        [20_000, 20_000, 20_000], [Share(weight=w) for w in WEIGHTS], epoch_size=50_000
    )
    assert counts == [25_000, 15_000, 10_000]
    mix = MixOrder(counts, mode="random", batch_size=1, seed=0, epoch=0)
    streams, _ = mix.locate(0, mix.total)
    assert np.bincount(streams).tolist() == counts, "exact counts over the epoch"
    held = np.stack([np.cumsum(streams == s) for s in range(3)], axis=1)
    n = np.arange(1, mix.total + 1)[:, None]
    # Stated tolerance: every prefix is within 64 samples of its weighted share, and every
    # window of 5,000 consecutive samples within 0.01 of each weight.
    assert np.abs(held - n * WEIGHTS).max() <= 64
    window = (held[5000:] - held[:-5000]) / 5000
    assert np.abs(window - WEIGHTS).max() <= 0.01
    # interleaved, not in runs: no stream holds a run of 50 samples
    runs = np.flatnonzero(np.diff(streams) != 0)
    assert np.diff(runs).max() < 50
    other = MixOrder(counts, mode="random", batch_size=1, seed=0, epoch=1).locate(0, 2000)[0]
    assert not np.array_equal(other, streams[:2000]), "each epoch deals anew"


def test_per_stream_batches_are_pure_and_stratified_counts_exact():
    counts = [700, 200, 100]
    per = MixOrder(counts, mode="per_stream", batch_size=8, seed=1, epoch=0)
    streams, _ = per.locate(0, per.total)
    batches = streams.reshape(-1, 8)
    assert (batches == batches[:, :1]).all(), "every batch from one stream"
    assert per.counts == [696, 200, 96], "whole batches of each stream"
    assert np.bincount(streams).tolist() == per.counts
    strat = MixOrder(counts, mode="stratified", batch_size=10, seed=1, epoch=0)
    streams, _ = strat.locate(0, strat.total)
    for batch in streams.reshape(-1, 10):
        assert np.bincount(batch, minlength=3).tolist() == [7, 2, 1]
    assert strat.counts == [700, 200, 100]


def test_shares_repeat_choose_and_weights():
    counts = stream_counts(
        [1000, 500, 10], [Share(weight=1.0), Share(choose=100), Share(repeat=2.5)]
    )
    assert counts == [1000, 100, 25]
    assert stream_counts([10, 10], [Share(weight=3), Share(weight=1)], epoch_size=8) == [6, 2]
    with pytest.raises(ValueError, match="one of"):
        Share(weight=1, choose=3)
    with pytest.raises(ValueError, match="epoch_size"):
        stream_counts([10], [Share(choose=20)], epoch_size=10)
    assert apportion(10, [7, 2, 1]) == [7, 2, 1] and sum(apportion(9, [1, 1, 1, 1])) == 9


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    mode=st.sampled_from(["random", "per_stream", "stratified"]),
    batch=st.integers(1, 9),
    block=st.integers(1, 40),
    seed=st.integers(0, 3),
    cuts=st.lists(st.integers(0, 10_000), max_size=4),
)
def test_a_range_of_the_mix_is_a_range_of_each_stream(counts, mode, batch, block, seed, cuts):
    mix = MixOrder(counts, mode=mode, batch_size=batch, seed=seed, epoch=2, block=block)
    streams, pos = mix.locate(0, mix.total)
    for s in range(len(counts)):
        mine = pos[streams == s]
        assert mine.tolist() == list(range(mix.counts[s])), "stream order read in order"
    bounds = sorted({0, mix.total, *(c % (mix.total + 1) for c in cuts)})
    for a, b in itertools.pairwise(bounds):
        got_s, got_p = mix.locate(a, b)
        assert np.array_equal(got_s, streams[a:b]) and np.array_equal(got_p, pos[a:b])
        lo, hi = mix.before(a), mix.before(b)
        assert (hi - lo).tolist() == np.bincount(streams[a:b], minlength=len(counts)).tolist()
    slot_bounds = [(x // mix.unit, y // mix.unit) for x, y in itertools.pairwise(bounds)]
    projected = mix.project(slot_bounds)
    for s in range(len(counts)):
        flat = [p for a, b in projected[s] for p in range(a, b)]
        want = [
            p
            for a, b in slot_bounds
            for p in pos[a * mix.unit : b * mix.unit][
                streams[a * mix.unit : b * mix.unit] == s
            ].tolist()
        ]
        assert flat == want


def test_subsample_is_whole_chunks_seeded_and_fixed_across_epochs():
    sizes = np.full(50, 10, dtype=np.int64)
    chosen = subsample_chunks(sizes, 0.1, seed=4)
    assert len(chosen) == 5 and chosen.tolist() == sorted(set(chosen.tolist()))
    assert subsample_chunks(sizes, 0.1, seed=4).tolist() == chosen.tolist()
    assert subsample_chunks(sizes, 0.1, seed=5).tolist() != chosen.tolist()

    class Units:
        units_per_chunk = sizes

        def keys_of(self, c: int) -> np.ndarray:
            return np.arange(c * 10, c * 10 + 10)

        def chunks_of(self, keys: np.ndarray) -> np.ndarray:
            return keys // 10

    for shuffle in (False, True):
        spec = OrderSpec(seed=4, shuffle=shuffle, subsample=0.1)
        for epoch in range(3):
            order = ReadOrder(Units(), spec, epoch)
            keys = order.keys(0, order.total)
            assert order.total == 50 and sorted(set(order.chunks_of(keys))) == chosen.tolist()
            assert sorted(keys.tolist()) == sorted(
                k for c in chosen for k in range(c * 10, c * 10 + 10)
            )


def test_epoch_size_truncates_or_wraps_with_a_new_shuffle():
    sizes = [7, 7, 7]

    class Units:
        units_per_chunk = np.array(sizes)

        def keys_of(self, c: int) -> np.ndarray:
            return np.arange(c * 7, c * 7 + 7)

        def chunks_of(self, keys: np.ndarray) -> np.ndarray:
            return keys // 7

    base = EpochOrder(sizes, Units().keys_of, seed=1, epoch=3, shuffle=True)
    short = ReadOrder(Units(), OrderSpec(seed=1, shuffle=True, epoch_size=10), 3)
    assert short.keys(0, 10).tolist() == base.keys(0, 10).tolist(), "truncated: a prefix"
    long = ReadOrder(Units(), OrderSpec(seed=1, shuffle=True, epoch_size=50), 3)
    keys = long.keys(0, 50)
    assert keys[:21].tolist() == base.keys(0, 21).tolist()
    assert sorted(keys[21:42].tolist()) == list(range(21)), "a whole second pass"
    assert keys[21:42].tolist() != keys[:21].tolist(), "shuffled anew"
    assert long.keys(17, 45).tolist() == keys[17:45].tolist()
    plain = collections.Counter(ReadOrder(Units(), OrderSpec(epoch_size=30), 0).keys(0, 30))
    assert all(plain[k] == (2 if k < 9 else 1) for k in range(21))
