"""MixedDataset through CacheDataLoader and real DataLoader workers (local datasets), and
StreamingDataset's subsample and epoch_size."""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, ConfigError, ResumeStateError, StreamingDataset
from asynccache.sampling.order import ReadOrder
from asynccache.testing.resume import assert_resumes_exactly
from asynccache.torch.mixed import MixedDataset, Stream
from tests.loader.mix_data import SIZES, mix, pairs, write_streams
from tests.loader.test_batch import per_item

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    return write_streams(str(tmp_path_factory.mktemp("mix")))


def expected(ds) -> collections.Counter:
    """Each stream's first ``count`` positions of its own order in epoch 0."""
    out: collections.Counter = collections.Counter()
    for s, n in enumerate(ds.stream_counts):
        order = ds._stream_order(s, 0)
        assert order.total == n
        out.update((s, int(k)) for k in order.keys(0, n))
    return out


@pytest.mark.parametrize("mode", ["random", "per_stream", "stratified"])
def test_modes_through_workers(urls, mode):
    ds = mix(urls, mode)
    batches = list(CacheDataLoader(ds, batch_size=8, num_workers=2))
    got = pairs(batches)
    assert collections.Counter(got) == expected(ds), "each stream's order, no extra samples"
    per_batch = [collections.Counter(int(s) for s in b["s"]) for b in batches]
    if mode == "random":
        assert ds.stream_counts == [300, 180, 120]
    if mode == "per_stream":
        assert all(len(c) == 1 for c in per_batch), "every batch from one stream"
        assert {next(iter(c)) for c in per_batch} == {0, 1, 2}
    if mode == "stratified":
        assert all(c == {0: 4, 1: 2, 2: 2} for c in per_batch), "exact counts per batch"


def test_resume_with_another_worker_count(urls):
    whole = pairs(list(CacheDataLoader(mix(urls, "per_stream"), batch_size=8, num_workers=1)))
    dl = CacheDataLoader(mix(urls, "per_stream"), batch_size=8, num_workers=1)
    it = iter(dl)
    first = [next(it) for _ in range(7)]
    state = dl.state_dict()
    del it
    again = CacheDataLoader(mix(urls, "per_stream"), batch_size=8, num_workers=2)
    again.load_state_dict(state)
    rest = list(again)
    assert all(len(set(b["s"].tolist())) == 1 for b in rest), "still pure after the resume"
    got = pairs(first) + pairs(rest)
    assert collections.Counter(got) == collections.Counter(whole), "nothing lost or repeated"
    assert pairs(first) == whole[: len(pairs(first))]


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mode=st.sampled_from(["random", "per_stream", "stratified"]),
    drop_last=st.booleans(),
    stop=st.integers(0, 80),
    batch=st.sampled_from([7, 16]),
)
@example(mode="random", drop_last=False, stop=0, batch=7)  # before the first batch
@example(mode="stratified", drop_last=True, stop=80, batch=16)  # after the last
@example(mode="per_stream", drop_last=True, stop=80, batch=7)
@example(mode="random", drop_last=True, stop=37, batch=16)  # the short batch dropped
def test_stop_anywhere_then_resume(urls, mode, drop_last, stop, batch):
    """The mix's whole batches, stopped and resumed anywhere, are the per-item path's
    batches, and the states taken are the per-item path's."""

    def loader(**kw):
        return CacheDataLoader(
            mix(urls, mode, batch_size=batch, drop_last=drop_last),
            batch_size=batch,
            drop_last=drop_last,
            **kw,
        )

    def stopped(**kw):
        dl = loader(**kw)
        it = iter(dl)
        return [next(it) for _ in range(stop)], dl.state_dict(), dl.batch_fallback

    whole = list(loader(collate_fn=per_item))  # the per-item path, uninterrupted
    stop = min(stop, len(whole))  # 0: before the first batch; len: after the last
    first, state, fallback = stopped()
    assert fallback is None, "the mix's batches come whole from its workers"
    assert state == stopped(collate_fn=per_item)[1]
    again = loader()
    again.load_state_dict(state)
    assert again.epoch == (1 if stop == len(whole) else 0)
    rest = list(again)
    if stop == len(whole):  # after the last batch: the next epoch, whole
        assert len(rest) == len(whole) and pairs(rest) != pairs(whole)
    else:
        assert pairs(first) + pairs(rest) == pairs(whole), "exact continuation"
    if drop_last:
        assert all(len(b["s"]) == batch for b in whole)


def test_resume_refuses_another_mix_or_order(urls):
    dl = CacheDataLoader(mix(urls), batch_size=8)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    other = CacheDataLoader(mix(urls, stream_kw={"subsample": 0.5}), batch_size=8)
    with pytest.raises(ResumeStateError, match=r"\['streams'\]\[0\]\['subsample'\]"):
        other.load_state_dict(state)
    with pytest.raises(ResumeStateError, match="mix"):
        CacheDataLoader(mix(urls, "stratified"), batch_size=8).load_state_dict(state)
    with pytest.raises(ConfigError, match="batch_size"):
        list(CacheDataLoader(mix(urls, "per_stream", batch_size=8), batch_size=4))
    ds = StreamingDataset(urls[0])
    with pytest.raises(ConfigError, match="same StreamingDataset"):
        MixedDataset([ds, ds])
    with pytest.raises(ConfigError, match="needs batch_size"):
        MixedDataset([ds], mode="stratified")
    with pytest.raises(ConfigError, match="one of weight"):
        MixedDataset([Stream(ds, weight=1, choose=3)])


def test_subsample_and_epoch_size_and_their_resume_state(urls):
    ds = StreamingDataset(urls[0], shuffle=True, seed=2, subsample=0.1)
    keys = [int(k) for b in CacheDataLoader(ds, batch_size=4, num_workers=2) for k in b["i"]]
    order = ReadOrder(ds.units, ds.order_spec, 0)
    assert order.chunks is not None and len(order.chunks) == 2  # 30 of 300 items: 2 chunks
    assert sorted({ds.index.locate(k)[0] for k in keys}) == order.chunks.tolist()
    assert sorted(keys) == sorted(int(k) for c in order.chunks for k in ds.index.chunk_keys(c))
    again = StreamingDataset(urls[0], shuffle=True, seed=2, subsample=0.1)
    again.set_epoch(5)
    assert {again.index.locate(int(x["i"]))[0] for x in again} == set(order.chunks.tolist())

    wrap = StreamingDataset(urls[2], shuffle=True, epoch_size=250)
    got = [int(k) for b in CacheDataLoader(wrap, batch_size=10) for k in b["i"]]
    assert len(got) == 250 and collections.Counter(got)[0] in (2, 3)
    assert set(got[:100]) == set(range(SIZES[2])) and set(got[100:200]) == set(range(SIZES[2]))

    dl = CacheDataLoader(StreamingDataset(urls[2], epoch_size=50), batch_size=10)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    for kw, name in (({"epoch_size": 60}, "epoch_size"), ({"subsample": 0.5}, "subsample")):
        with pytest.raises(ResumeStateError, match=name):
            CacheDataLoader(StreamingDataset(urls[2], **kw), batch_size=10).load_state_dict(state)
    with pytest.raises(ConfigError, match="subsample"):
        StreamingDataset(urls[2], subsample=1.5)


def test_resume_conformance_of_a_mix_and_of_a_wrapped_subsample(urls):
    def mixed():
        return CacheDataLoader(mix(urls, "stratified", batch_size=8), batch_size=8)

    n = len(mixed())
    # (after the last batch the loader goes on with the next epoch: tested above)
    assert_resumes_exactly(mixed, [0, 1, n // 2, n - 1])

    def wrapped():
        ds = StreamingDataset(urls[0], shuffle=True, seed=4, subsample=0.2, epoch_size=130)
        return CacheDataLoader(ds, batch_size=16, drop_last=True)

    n = len(wrapped())
    assert n == 130 // 16
    assert_resumes_exactly(wrapped, [0, 3, n - 1])
