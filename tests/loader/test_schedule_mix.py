"""Mixture schedules through CacheDataLoader (local streams, real DataLoader workers):

* the batch at global step ``S`` is dealt with the weights of step ``S`` (no stream of
  weight 0 in it; ``stratified``: its exact per-stream counts), and each stream is read in
  its own order, no sample twice within a pass;
* stopped anywhere around the weight changes and resumed in a fresh loader, exact
  (hypothesis over stop points); resumed with another world size, nothing lost or
  repeated; resumed with another schedule, refused naming it;
* the ranks of one data-parallel group get the same batches, and every DP rank meets the
  same weights at the same step.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, ConfigError, ResumeStateError, StreamingDataset
from asynccache.sampling.mix import apportion
from asynccache.torch.mixed import MixedDataset, Stream
from tests.loader.mix_data import pairs, write_streams
from tests.loader.test_resume_property import as_rank

pytestmark = pytest.mark.timeout(600)
SCHEDULE = [(0, [1, 0, 1]), (5, [0, 1, 0]), (9, [3, 2, 1]), (40, [0, 0, 1])]


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    return write_streams(str(tmp_path_factory.mktemp("mix")))


def smix(urls: list[str], mode: str = "random", batch: int = 8, **kw: Any) -> MixedDataset:
    schedule = kw.pop("schedule", SCHEDULE)
    streams = [
        Stream(StreamingDataset(u, shuffle=True, seed=s, **kw.pop("stream_kw", {})))
        for s, u in enumerate(urls)
    ]
    return MixedDataset(streams, mode=mode, batch_size=batch, seed=3, schedule=schedule, **kw)


def weights_at(step: int, schedule: list = SCHEDULE) -> list[int]:
    return [w for s, w in schedule if s <= step][-1]


def streams_of(batch: Any) -> list[int]:
    return [int(s) for s in batch["s"]]


@pytest.mark.parametrize("mode", ["random", "per_stream", "stratified"])
def test_each_step_meets_its_weights_and_streams_keep_their_order(urls, mode):
    ds = smix(urls, mode, drop_last=True)
    dl = CacheDataLoader(ds, batch_size=8, num_workers=2, drop_last=True)
    per = dl.steps_per_epoch
    for epoch in range(2):
        batches = list(dl)
        assert len(batches) == per
        for t, b in enumerate(batches):
            w = weights_at(epoch * per + t)
            got = streams_of(b)
            assert all(w[s] > 0 for s in got), (epoch, t, w, got)
            if mode == "stratified":
                want = apportion(8, w)
                assert collections.Counter(got) == {s: c for s, c in enumerate(want) if c}
            if mode == "per_stream":
                assert len(set(got)) == 1
        counts = ds.stream_counts
        for s in range(3):  # each stream: the first counts[s] positions of its order
            mine = [i for si, i in pairs(batches) if si == s]
            order = ds._stream_order(s, epoch)
            assert sorted(mine) == sorted(int(k) for k in order.keys(0, len(mine)))
            assert len(mine) <= counts[s]
    # a callable giving the same weights deals the same epochs
    same = smix(urls, mode, drop_last=True, schedule=lambda e, s: weights_at(s))
    again = CacheDataLoader(same, batch_size=8, num_workers=0, drop_last=True)
    ref = CacheDataLoader(smix(urls, mode, drop_last=True), batch_size=8, drop_last=True)
    assert pairs(list(again)) == pairs(list(ref))


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    mode=st.sampled_from(["random", "per_stream", "stratified"]),
    batch=st.sampled_from([5, 8]),
    drop_last=st.booleans(),
    change=st.sampled_from([5, 9, 40]),
    around=st.integers(-2, 2),
    epoch=st.integers(0, 1),
)
@example(mode="random", batch=8, drop_last=False, change=5, around=0, epoch=0)
@example(mode="stratified", batch=5, drop_last=True, change=40, around=1, epoch=1)
def test_stop_around_a_change_then_resume_exactly(urls, mode, batch, drop_last, change,
                                                  around, epoch):  # fmt: skip
    def loader() -> CacheDataLoader:
        ds = smix(urls, mode, batch=batch, drop_last=drop_last)
        return CacheDataLoader(ds, batch_size=batch, drop_last=drop_last)

    whole = [pairs(list(dl)) for dl in [loader()] for _ in range(2)]
    per = loader().steps_per_epoch
    stop = min(max(0, change + around - epoch * per), per)  # batches into `epoch`
    dl = loader()
    head = []
    for e in range(epoch + 1):
        it = iter(dl)
        for t, b in enumerate(it):
            head += pairs([b])
            if e == epoch and t + 1 == stop:
                break
    state = dl.state_dict()
    again = loader()
    again.load_state_dict(state)
    rest = [p for _ in range(again.epoch, 2) for p in pairs(list(again))]
    assert head + rest == whole[0] + whole[1], "exact across the change of weights"


def test_another_world_size_mid_epoch_reads_exactly_what_was_left(urls):
    """Saved by two DP ranks at step 6, resumed by one process: the epoch keeps the split
    it was dealt by (its state names it), so nothing is lost or repeated but padding."""

    def loader(**kw: Any) -> CacheDataLoader:
        return CacheDataLoader(smix(urls, "random", **kw), batch_size=8)

    whole = collections.Counter()
    heads = collections.Counter()
    states = []
    for r in range(2):
        with as_rank(r, 2):
            whole.update(pairs(list(loader())))
            dl = loader()
            it = iter(dl)
            heads.update(pairs([next(it) for _ in range(6)]))
            states.append(dl.state_dict())
    assert states[0] == states[1], "every rank saves the same state"
    assert states[0]["stream"]["layout"] == [2, 1, 8, False]
    one = loader()
    one.load_state_dict(states[0])
    rest = collections.Counter(pairs(list(one)))
    assert not whole - (heads + rest), "nothing lost"
    assert sum((heads + rest - whole).values()) <= 1, "nothing repeated but padding"
    nxt = list(one)  # the next epoch: split as this process splits it, one DP rank
    per = one.steps_per_epoch
    for t, b in enumerate(nxt):
        assert all(weights_at(per + t)[s] > 0 for s in streams_of(b))


def test_replicas_and_dp_ranks_meet_the_same_weights(urls):
    got, want = [], collections.Counter()
    for r in range(4):
        with as_rank(r, 4):
            ds = smix(urls, "random", replication=2)
            got.append(list(CacheDataLoader(ds, batch_size=8)))
            if r == 0:  # each stream: the first counts[s] positions of its order, once
                for s, n in enumerate(ds.stream_counts):
                    want.update((s, int(k)) for k in ds._stream_order(s, 0).keys(0, n))
    assert pairs(got[0]) == pairs(got[1]) and pairs(got[2]) == pairs(got[3])
    assert collections.Counter(pairs(got[0]) + pairs(got[2])) == want, "DP ranks: the epoch"
    for t, (a, b) in enumerate(zip(got[0], got[2], strict=True)):
        w = weights_at(t)
        assert all(w[s] > 0 for s in streams_of(a) + streams_of(b)), t


def test_resume_with_another_schedule_is_refused(urls):
    dl = CacheDataLoader(smix(urls), batch_size=8)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    other = [(0, [1, 0, 1]), (6, [0, 1, 0])]
    for ds in (smix(urls, schedule=other), MixedDataset([StreamingDataset(u) for u in urls])):
        with pytest.raises(ResumeStateError, match="schedule"):
            CacheDataLoader(ds, batch_size=8).load_state_dict(state)
    # a callable schedule: a state of its epoch names its weights
    fn = CacheDataLoader(smix(urls, schedule=lambda e, s: weights_at(s)), batch_size=8)
    it = iter(fn)
    next(it)
    state = fn.state_dict()
    changed = smix(urls, schedule=lambda e, s: weights_at(s + 1))
    with pytest.raises(ResumeStateError, match="schedule"):
        CacheDataLoader(changed, batch_size=8).load_state_dict(state)
    same = CacheDataLoader(smix(urls, schedule=lambda e, s: weights_at(s)), batch_size=8)
    same.load_state_dict(state)
    with pytest.raises(ConfigError, match="repeat= or choose="):
        MixedDataset([Stream(StreamingDataset(urls[0]), repeat=1)], schedule=SCHEDULE[:1])
    with pytest.raises(ConfigError, match="step 0"):
        smix(urls, schedule=[(3, [1, 1, 1])])
    with pytest.raises(ConfigError, match="2 weights for 3 streams"):
        list(CacheDataLoader(smix(urls, schedule=lambda e, s: [1, 1]), batch_size=8))
