"""Mixture schedules (pure): each step's slots are dealt with that step's weights, each
stream is still read in its own order, and the deal is a pure function of its inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.sampling.mix import Schedule, ScheduledMix, apportion
from asynccache.sampling.partition import plan
from asynccache.sampling.steps import Layout

STREAMS = 3
weights = st.lists(st.integers(0, 4), min_size=STREAMS, max_size=STREAMS).filter(any)


@st.composite
def schedules(draw):
    steps = sorted(set(draw(st.lists(st.integers(1, 40), max_size=4))))
    return [(s, draw(weights)) for s in [0, *steps]]


@st.composite
def mixes(draw):
    mode = draw(st.sampled_from(["random", "per_stream", "stratified"]))
    unit = 1 if mode == "random" else draw(st.integers(1, 5))
    layout = Layout(
        world=draw(st.integers(1, 4)),
        batch=draw(st.integers(1, 6)) if mode == "random" else 1,
        drop_last=draw(st.booleans()),
        drop_short=draw(st.booleans()),
        workers=draw(st.integers(1, 3)),
    )
    total = draw(st.integers(0, 300)) * unit
    spec = draw(schedules())
    epoch = draw(st.integers(0, 3))
    mix = ScheduledMix(
        total,
        Schedule(spec, STREAMS),
        layout,
        mode=mode,
        batch_size=unit,
        seed=draw(st.integers(0, 5)),
        epoch=epoch,
        block=draw(st.sampled_from([3, 1024])),
    )
    return mix, spec


def step_weights(spec, step):
    return [w for s, w in spec if s <= step][-1]


@settings(max_examples=300, deadline=None)
@given(got=mixes())
def test_each_step_is_dealt_with_its_weights_and_streams_keep_their_order(got):
    mix, spec = got
    lay, u = mix.layout, mix.unit
    streams, pos = mix.locate(0, mix.total)
    # each stream's k-th sample in slot order reads position k of its order
    for s in range(STREAMS):
        assert pos[streams == s].tolist() == list(range(mix.counts[s]))
    for p in range(0, mix.total + 1, max(1, mix.total // 17)):
        assert mix.before(p).tolist() == np.bincount(streams[:p], minlength=STREAMS).tolist()
    a, b = sorted((mix.total // 3, 2 * mix.total // 5))
    part_s, part_p = mix.locate(a, b)
    assert part_s.tolist() == streams[a:b].tolist() and part_p.tolist() == pos[a:b].tolist()
    # Each rank's step t, as the partition delivers it (batch t from worker t % K): the
    # weights of global step epoch * B + t (padding repeats the epoch's first slots).
    steps = lay.steps(mix.slots)
    for r in range(lay.world):
        for t, batch in enumerate(delivered(mix.slots, lay, r)[:steps]):
            w = step_weights(spec, mix.epoch * steps + t)
            for q in batch:
                seen = streams[q * u : (q + 1) * u]
                assert all(w[s] > 0 for s in seen.tolist()), "no stream of weight 0"
                if mix.mode == "stratified":
                    got_q = np.bincount(seen, minlength=STREAMS).tolist()
                    assert got_q == apportion(u, w), "every batch: its exact counts"


def delivered(slots: int, lay: Layout, rank: int) -> list[list[int]]:
    """Rank ``rank``'s batches (slots, padding left out) in the order its consumer gets
    them: batch t is batch t // K of worker t % K's run."""
    p = plan(
        [(0, slots)] if slots else [],
        world=lay.world,
        rank=rank,
        num_workers=lay.workers,
        batch_size=lay.batch,
        drop_last=lay.drop_last,
    )
    per_worker = []
    for segs in p.workers:
        flat = [(q, seg.pad) for seg in segs for q in range(seg.start, seg.end)]
        per_worker.append([flat[i : i + lay.batch] for i in range(0, len(flat), lay.batch)])
    out = []
    for t in range(sum(len(x) for x in per_worker)):
        batch = per_worker[t % lay.workers][t // lay.workers]
        out.append([q for q, pad in batch if not pad])
    return out


def test_a_callable_schedule_deals_as_the_same_list():
    spec = [(0, [1, 0, 1]), (5, [0, 1, 0]), (9, [2, 1, 1])]
    lay = Layout(world=2, batch=4)

    def fn(epoch, step):
        return step_weights(spec, step)

    a = ScheduledMix(400, Schedule(spec, 3), lay, mode="random", batch_size=1, seed=1, epoch=1)
    b = ScheduledMix(400, Schedule(fn, 3), lay, mode="random", batch_size=1, seed=1, epoch=1)
    assert [x.tolist() for x in a.locate(0, 400)] == [x.tolist() for x in b.locate(0, 400)]
    assert a.counts == b.counts and sum(a.counts) == 400
    c = ScheduledMix(400, Schedule(spec, 3), lay, mode="random", batch_size=1, seed=1, epoch=2)
    assert c.locate(0, 400)[0].tolist() != a.locate(0, 400)[0].tolist(), "epochs deal anew"
    # epoch 1 of 50 steps a rank: steps 50..99, all past the last change
    assert set(a.locate(0, 400)[0].tolist()) == {0, 1, 2}
    sched = Schedule(fn, 3)
    assert sched.digest(1, 50, 50) == Schedule(spec, 3).digest(1, 50, 50)
    assert sched.digest(0, 0, 50) != sched.digest(1, 50, 50)


@pytest.mark.parametrize(
    "spec, match",
    [
        ([], "non-empty"),
        ([(1, [1, 1])], "step 0"),
        ([(0, [1, 1]), (0, [1, 2])], "increase"),
        ([(0, [1])], "1 weights for 2"),
        ([(0, [0, 0])], "> 0"),
        ([(0, [1, float("nan")])], "finite"),
        ([(0, [1, -1])], ">= 0"),
        ([(0, [1, True])], "not a number"),
        ([(-1, [1, 1])], "integer >= 0"),
        ([(0, "ab")], "list of 2"),
    ],
)
def test_malformed_schedules_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        Schedule(spec, 2)
    bad = Schedule(lambda e, s: [1], 2)
    with pytest.raises(ValueError, match="1 weights for 2"):
        bad.weights(0, 3)
