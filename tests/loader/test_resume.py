"""Resume: stop anywhere, continue in a fresh loader, get exactly the rest of the epoch."""

from __future__ import annotations

import pickle

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
