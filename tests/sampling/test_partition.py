"""The pure sampler: exact coverage, equal ranks, and resume across world/worker changes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.sampling import EpochOrder, consumed_to_remaining, plan


def receive_order(remaining, *, world, rank, W, B, drop_last):
    """What a DataLoader hands the consumer of ``rank``: batch p from worker p mod W."""
    p = plan(remaining, world=world, rank=rank, num_workers=W, batch_size=B, drop_last=drop_last)
    per_worker = []
    for segs in p.workers:
        items = [(pos, s.pad) for s in segs for pos in range(s.start, s.end)]
        per_worker.append([items[i : i + B] for i in range(0, len(items), B)])
    out, k = [], 0
    while any(per_worker):
        w = k % W
        assert per_worker[w], f"worker {w} ran dry out of round-robin order"
        out.append(per_worker[w].pop(0))
        k += 1
    return out, p.rank_samples


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 120),
    world=st.integers(1, 4),
    W=st.integers(1, 3),
    B=st.integers(1, 7),
    drop_last=st.booleans(),
)
def test_each_sample_once_and_ranks_equal(n, world, W, B, drop_last):
    seen, lengths = [], set()
    for rank in range(world):
        batches, n_rank = receive_order(
            [(0, n)] if n else [], world=world, rank=rank, W=W, B=B, drop_last=drop_last
        )
        flat = [x for b in batches for x in b]
        assert len(flat) == n_rank
        assert all(len(b) == B for b in batches[:-1])
        lengths.add(len(flat))
        seen += [pos for pos, pad in flat if not pad]
    assert len(lengths) == 1, "every rank takes the same number of samples"
    expect = list(range(n - (n % world if drop_last else 0)))
    assert sorted(seen) == expect


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(1, 150),
    old=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    stop=st.floats(0, 1),
)
def test_resume_after_world_and_worker_change_is_exact(n, old, new, stop):
    world, W, B = old
    batches, _ = receive_order([(0, n)], world=world, rank=0, W=W, B=B, drop_last=False)
    k = round(stop * len(batches))
    received = sum(len(b) for b in batches[:k])
    pre = []
    for rank in range(world):
        bs, _ = receive_order([(0, n)], world=world, rank=rank, W=W, B=B, drop_last=False)
        pre += [pos for b in bs[:k] for pos, pad in b if not pad]
    rest = consumed_to_remaining(
        [(0, n)], world=world, num_workers=W, batch_size=B, drop_last=False, received=received
    )
    post = []
    for rank in range(new[0]):
        bs, _ = receive_order(rest, world=new[0], rank=rank, W=new[1], B=B, drop_last=False)
        post += [pos for b in bs for pos, pad in b if not pad]
    assert len(set(pre)) == len(pre), "nothing repeated before the stop"
    assert len(set(post)) == len(post), "nothing repeated after the resume"
    assert not set(pre) & set(post), "nothing both before and after"
    assert sorted(pre + post) == list(range(n)), "nothing missed"


def test_resuming_twice_composes():
    n, B = 97, 4
    rest = [(0, n)]
    got: list[int] = []
    for world, W, k in [(2, 2, 3), (3, 1, 2), (1, 3, 5)]:
        for rank in range(world):
            bs, _ = receive_order(rest, world=world, rank=rank, W=W, B=B, drop_last=False)
            got += [pos for b in bs[:k] for pos, pad in b if not pad]
        rest = consumed_to_remaining(
            rest, world=world, num_workers=W, batch_size=B, drop_last=False, received=k * B
        )
    for rank in range(2):
        bs, _ = receive_order(rest, world=2, rank=rank, W=2, B=B, drop_last=False)
        got += [pos for b in bs for pos, pad in b if not pad]
    assert sorted(set(got)) == list(range(n))


def test_workers_read_contiguous_runs():
    p = plan([(0, 1000)], world=2, rank=1, num_workers=2, batch_size=10, drop_last=False)
    assert [[(s.start, s.end) for s in segs] for segs in p.workers] == [[(500, 750)], [(750, 1000)]]


def chunk_keys(sizes):
    out, pos = [], 0
    for s in sizes:
        out.append(np.arange(pos, pos + s))
        pos += s
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_order_is_a_deterministic_permutation(shuffle):
    keys = chunk_keys([10, 7, 13, 10, 5, 9])
    a = EpochOrder(
        [len(k) for k in keys], keys.__getitem__, seed=1, epoch=0, shuffle=shuffle, window=2
    )
    b = EpochOrder(
        [len(k) for k in keys], keys.__getitem__, seed=1, epoch=0, shuffle=shuffle, window=2
    )
    whole = a.keys(0, len(a))
    assert sorted(whole.tolist()) == list(range(54))
    assert whole.tolist() == b.keys(0, 54).tolist()
    pieces = np.concatenate([a.keys(i, min(i + 5, 54)) for i in range(0, 54, 5)])
    assert pieces.tolist() == whole.tolist(), "ranges agree with the whole"
    c = EpochOrder(
        [len(k) for k in keys], keys.__getitem__, seed=1, epoch=1, shuffle=shuffle, window=2
    ).keys(0, 54)
    assert (c.tolist() != whole.tolist()) == shuffle


def same_chunk_neighbours(order, size):
    return float(np.mean(order[1:] // size == order[:-1] // size))


def test_shuffle_mixes_across_chunks_better_than_within_chunk_shuffle():
    size, chunks = 100, 40
    keys = chunk_keys([size] * chunks)
    ours = EpochOrder(
        [len(k) for k in keys], keys.__getitem__, seed=0, epoch=0, shuffle=True, window=4
    ).keys(0, size * chunks)
    rng = np.random.default_rng(0)
    within = np.concatenate([rng.permutation(k) for k in rng.permutation(keys)])
    a, b = same_chunk_neighbours(ours, size), same_chunk_neighbours(within, size)
    assert b > 0.95, "within-chunk shuffle keeps nearly all neighbours in one chunk"
    assert a < 0.4, f"window shuffle must mix chunks (got {a:.2f})"
    # Position correlation: how well an item's position predicts its neighbour's chunk.
    rho = np.corrcoef(np.arange(len(ours)), ours)[0, 1]
    assert abs(rho) < 0.3
