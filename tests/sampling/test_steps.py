"""Steps (pure): a step's position is exactly an uninterrupted consumer's, skipped ranges
land past themselves, data-parallel groups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.sampling.groups import check_dp, replicated
from asynccache.sampling.partition import plan
from asynccache.sampling.steps import Layout, Skips


def delivered(total: int, layout: Layout, rank: int) -> list[list[int]]:
    """The batches (positions of S) rank ``rank``'s consumer receives in one epoch, as the
    partition plans them (one worker): what a step must count."""
    p = plan(
        [(0, total)] if total else [],
        world=layout.world,
        rank=rank,
        num_workers=1,
        batch_size=layout.batch,
        drop_last=layout.drop_last,
    )
    flat = [q for seg in p.workers[0] for q in range(seg.start, seg.end)]
    out = [flat[i : i + layout.batch] for i in range(0, len(flat), layout.batch)]
    if layout.drop_short and out and len(out[-1]) < layout.batch:
        out.pop()
    return out


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 200),
    world=st.integers(1, 5),
    batch=st.integers(1, 9),
    drop_last=st.booleans(),
    drop_short=st.booleans(),
    data=st.data(),
)
def test_steps_are_the_batches_a_consumer_receives(
    total, world, batch, drop_last, drop_short, data
):
    layout = Layout(world, batch, drop_last, drop_short)
    got = delivered(total, layout, data.draw(st.integers(0, world - 1)))
    assert layout.steps(total) == len(got), "every rank, every epoch: the same steps"
    if not got:
        with pytest.raises(ValueError, match="no steps"):
            layout.locate(0, total)
        return
    step = data.draw(st.integers(0, 5 * len(got)))
    epoch, b = layout.locate(step, total)
    assert epoch * len(got) + b == step and 0 <= b < len(got)
    # the position: all the batches before it received, and counted back from the end
    received = layout.received(b, total)
    assert received == sum(len(x) for x in got[:b])
    left = layout.rank_samples(total) - received
    assert layout.batch_at(left, total) == b


def test_a_step_of_a_huge_run_is_a_few_integers():
    layout = Layout(world=8, batch=32)
    assert layout.locate(10**15 + 5, 10**6) == divmod(10**15 + 5, 3907)
    with pytest.raises(ValueError, match=">= 0"):
        layout.locate(-1, 100)


@settings(max_examples=300, deadline=None)
@given(
    ranges=st.lists(
        st.tuples(st.integers(0, 60), st.integers(1, 20)).map(lambda t: (t[0], t[0] + t[1])),
        max_size=6,
    ),
    step=st.integers(0, 100),
)
def test_skips_land_on_the_first_step_not_skipped(ranges, step):
    skips = Skips(ranges)
    inside = {s for a, b in ranges for s in range(a, b)}
    land = skips.landing(step)
    assert land >= step and land not in inside
    assert all(s in inside for s in range(step, land)), "the first not skipped"
    nxt = skips.next_start(land)
    later = [a for a, _ in skips.ranges if a > land]
    assert nxt == (min(later) if later else None)
    assert skips.count(0, 100) == len(inside & set(range(100)))
    assert Skips.from_json(skips.to_json()) == skips
    assert skips.union(Skips([(200, 210)])).landing(205) == 210


@pytest.mark.parametrize(
    "raw",
    [[[3, 3]], [[-1, 2]], [[1.0, 2]], [[True, 4]], [[1, 2, 3]], "0-4", [5]],
)
def test_malformed_skips_are_refused(raw):
    with pytest.raises(ValueError):
        Skips.from_json(raw)


def test_data_parallel_groups():
    # four ranks, two replicas each: 0,1 read as DP rank 0; 2,3 as DP rank 1
    assert [replicated(r, 4, 2) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert replicated(5, 6, 1) == (5, 6)
    with pytest.raises(ValueError, match="does not divide"):
        replicated(0, 6, 4)
    with pytest.raises(ValueError, match="positive integer"):
        replicated(0, 4, 0)
    assert check_dp(1, 2) == (1, 2)
    for bad in [(2, 2), (-1, 2), (True, 2), (0.5, 2), ("0", 2)]:
        with pytest.raises(ValueError):
            check_dp(*bad)
