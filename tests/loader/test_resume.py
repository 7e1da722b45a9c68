"""Resume: stop anywhere, continue in a fresh loader, get exactly the rest of the epoch."""

from __future__ import annotations

import contextlib
import pickle
import threading
import time

import pytest
import torch

from asynccache import CacheDataLoader, ResumeStateError
from asynccache.testing.resume import assert_resumes_exactly
from asynccache.torch.fetcher import Fetcher
from asynccache.torch.streaming import StreamingDataset
from tests.loader.datasets import DictDataset

N, B = 53, 4


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds")
    list(CacheDataLoader(DictDataset(N), cache_dir=path, chunk_size=7, batch_size=8))
    return path


def loader(path, workers=2, seed=5, shuffle=True, **kw):
    ds = StreamingDataset(path, shuffle=shuffle, seed=seed, shuffle_window=2)
    return CacheDataLoader(ds, batch_size=B, num_workers=workers, **kw)


def keys_of(batch):
    return batch["i"].tolist()


def run(dl, stop=None, state=None):
    """Consume (through a prefetching Fetcher) up to ``stop`` batches; return keys, state."""
    if state is not None:
        dl.load_state_dict(pickle.loads(pickle.dumps(state)))
    got = []
    with Fetcher(dl, prefetch_batches=3) as f:
        for i, batch in enumerate(f):
            if stop is not None and i == stop:
                break
            got += keys_of(batch)
            if stop is not None and i + 1 == stop:
                return got, f.state_dict()
        return got, f.state_dict()


def test_conformance_at_start_middle_and_end(written):
    # (A stop after the last batch resumes with the next epoch: see the boundary test.)
    n_batches = -(-N // B)
    assert_resumes_exactly(lambda: loader(written), [0, 1, 6, n_batches - 1])


@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 3), (0, 2), (3, 0)])
@pytest.mark.parametrize("stop", [1, 5, 9])
def test_resume_with_another_worker_count(written, before, after, stop):
    pre, state = run(loader(written, workers=before), stop=stop)
    post, _ = run(loader(written, workers=after), state=state)
    assert len(pre) == stop * B
    assert sorted(pre + post) == list(range(N)), "nothing repeated, nothing missed"


def test_resume_twice(written):
    a, s1 = run(loader(written, workers=2), stop=3)
    b, s2 = run(loader(written, workers=3), stop=4, state=s1)
    c, _ = run(loader(written, workers=1), state=s2)
    assert sorted(a + b + c) == list(range(N))


def test_resume_across_the_epoch_boundary(written):
    ref = loader(written)
    epochs = [run(ref)[0] for _ in range(3)]
    assert epochs[0] != epochs[1] and sorted(epochs[1]) == list(range(N))
    # Stop exactly at the end of epoch 0: the resumed loader starts epoch 1.
    dl = loader(written)
    full, state = run(dl)
    assert full == epochs[0]
    nxt, _ = run(loader(written), state=state)
    assert nxt == epochs[1]
    # Stop in the middle of epoch 1: the rest of epoch 1, then epoch 2 as in the reference.
    dl = loader(written)
    run(dl)
    mid, state = run(dl, stop=5)
    resumed = loader(written)
    rest, _ = run(resumed, state=state)
    assert mid + rest == epochs[1]
    assert run(resumed)[0] == epochs[2]


def test_state_is_constant_size(written):
    small = pickle.dumps(run(loader(written), stop=1)[1])
    large = pickle.dumps(run(loader(written), stop=12)[1])
    assert abs(len(small) - len(large)) < 64


@pytest.mark.parametrize(
    ("change", "match"), [({"seed": 6}, "seed"), ({"shuffle": False}, "shuffle")]
)
def test_state_from_another_setting_is_refused(written, change, match):
    _, state = run(loader(written), stop=2)
    with pytest.raises(ResumeStateError, match=match):
        loader(written, **change).load_state_dict(state)


def test_state_from_another_dataset_is_refused(written, tmp_path):
    list(CacheDataLoader(DictDataset(N + 1), cache_dir=tmp_path, chunk_size=7))
    _, state = run(loader(written), stop=2)
    with pytest.raises(ResumeStateError, match="dataset"):
        loader(tmp_path).load_state_dict(state)


def test_the_writing_epoch_resumes_exactly(tmp_path):
    def make():
        return CacheDataLoader(
            DictDataset(30),
            cache_dir=tmp_path,
            chunk_size=4,
            batch_size=3,
            num_workers=2,
            shuffle=True,
            seed=1,
        )

    reference = torch.cat(
        [
            b["i"]
            for b in CacheDataLoader(
                DictDataset(30),
                cache_dir=tmp_path / "ref",
                chunk_size=4,
                batch_size=3,
                num_workers=2,
                shuffle=True,
                seed=1,
            )
        ]
    ).tolist()
    pre, state = run(make(), stop=4)
    assert state["writing"] and not (tmp_path / "index.json").exists()
    post, _ = run(make(), state=state)
    assert pre + post == reference
    assert (tmp_path / "index.json").exists()
    with pytest.raises(ResumeStateError, match="same"):
        CacheDataLoader(
            DictDataset(30),
            cache_dir=tmp_path / "other",
            batch_size=3,
            num_workers=1,
            shuffle=True,
            seed=1,
        ).load_state_dict(state)


def test_shuffle_belongs_to_the_streaming_dataset(written):
    from asynccache import ConfigError

    with pytest.raises(ConfigError, match="StreamingDataset"):
        CacheDataLoader(StreamingDataset(written), shuffle=True)


# -- epoch edges -------------------------------------------------------------------


def streamed_epochs(dl, epochs=3):
    return [[k for b in dl for k in keys_of(b)] for _ in range(epochs)]


@pytest.mark.parametrize("fetcher", [False, True])
def test_a_state_between_iter_and_the_first_batch_of_a_later_epoch(written, fetcher):
    ref = streamed_epochs(loader(written, workers=0))
    dl = loader(written, workers=0)
    src = Fetcher(dl, prefetch_batches=2) if fetcher else dl
    with contextlib.ExitStack() as stack:
        if fetcher:
            stack.enter_context(src)
        list(src)  # epoch 0
        iter(src)  # epoch 1 starts; no batch yet
        state = pickle.loads(pickle.dumps(src.state_dict()))
    resumed = loader(written, workers=0)
    resumed.load_state_dict(state)
    first = resumed.epoch
    assert streamed_epochs(resumed, 2) == ref[1:], "epoch 1 from its start, then epoch 2"
    assert first == 1


@pytest.mark.parametrize("writing", [False, True])
def test_drop_last_state_after_the_last_full_batch_resumes_the_next_epoch(
    written, tmp_path, writing
):
    def make(path):
        if writing:
            return CacheDataLoader(
                DictDataset(N), cache_dir=path, chunk_size=7, batch_size=B, drop_last=True
            )
        return CacheDataLoader(str(written), batch_size=B, drop_last=True)

    ref = streamed_epochs(make(tmp_path / "ref"), 2)
    assert len(ref[0]) == N // B * B
    dl = make(tmp_path / "run")
    epoch0 = list(dl)
    state = dl.state_dict()
    resumed = make(tmp_path / "run")
    resumed.load_state_dict(state)
    assert len(epoch0) == N // B and resumed.epoch == 1
    assert [k for b in resumed for k in keys_of(b)] == ref[1], "epoch 1, not an empty epoch 0"


@pytest.mark.parametrize("stop", [0, 4, 9])
def test_a_writing_state_loads_after_the_merge(tmp_path, stop):
    def make(path, workers=2):
        return CacheDataLoader(
            DictDataset(29), cache_dir=path, chunk_size=4, batch_size=3, num_workers=workers,
            shuffle=True, seed=1,
        )  # fmt: skip

    ref = streamed_epochs(make(tmp_path / "ref"), 2)
    dl = make(tmp_path / "run")
    it = iter(dl)
    before = [k for _, b in zip(range(stop), it, strict=False) for k in keys_of(b)]
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    assert state["writing"]
    rest = [k for b in it for k in keys_of(b)]  # the epoch ends: the cache is merged
    assert before + rest == ref[0] and (tmp_path / "run" / "index.json").exists()
    resumed = make(tmp_path / "run", workers=1)  # the cache is read: any worker count
    resumed.load_state_dict(state)
    assert resumed.epoch == 0 and len(resumed) == 10, "the whole epoch, as Lightning counts"
    assert [k for b in resumed for k in keys_of(b)] == rest, "the rest of epoch 0, in order"
    epoch1 = [k for b in resumed for k in keys_of(b)]  # streamed, split for one worker
    assert sorted(epoch1) == list(range(29)) and epoch1 != ref[0]


def test_a_writing_state_after_its_last_batch_resumes_the_next_epoch_unmerged(tmp_path):
    def make(path):
        return CacheDataLoader(
            DictDataset(29), cache_dir=path, chunk_size=4, batch_size=3, shuffle=True, seed=1
        )

    ref = streamed_epochs(make(tmp_path / "ref"), 2)
    dl = make(tmp_path / "run")
    it = iter(dl)
    assert len([next(it) for _ in range(10)]) == 10  # every batch, the merge not yet run
    state = dl.state_dict()
    it.close()  # the process stops before the merge
    assert not (tmp_path / "run" / "index.json").exists()
    resumed = make(tmp_path / "run")
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert [k for b in resumed for k in keys_of(b)] == ref[1], "written, then epoch 1"
    assert (tmp_path / "run" / "index.json").exists()


@pytest.mark.timeout(60)
def test_a_fetcher_thread_that_outlives_close_never_advances_the_loader(written):
    entered, release = threading.Event(), threading.Event()

    def stall(item):
        if item["i"] == 2 * B:  # the first item of batch 2
            entered.set()
            release.wait(30)  # bounded, so the test cannot hang
        return item

    dl = CacheDataLoader(StreamingDataset(written, transform=stall), batch_size=B)
    fetcher = Fetcher(dl, prefetch_batches=1, close_timeout_s=0.1)
    it = iter(fetcher)
    assert keys_of(next(it)) == list(range(B))
    assert entered.wait(30), "the producer reached batch 2"
    counted = dl.state_dict()
    fetcher.close()  # gives up: the producer is stuck inside the loader
    release.set()  # now the loader hands batch 2 to a closed fetcher
    deadline = time.monotonic() + 30
    while any(t.name == "asynccache-fetcher" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the producer thread never left the loader"
        time.sleep(0.01)
    assert dl.state_dict() == counted, "a batch produced after close() was counted"
    assert counted["stream"]["received"] == 2 * B  # what the thread took before close
