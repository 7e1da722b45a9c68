"""torchdata's StatefulDataLoader over a StreamingDataset: per-worker state, mid-epoch save
and load, exactly the rest of the epoch."""

from __future__ import annotations

import pickle

import pytest

from asynccache import CacheDataLoader, ResumeStateError, StreamingDataset
from tests.loader.datasets import DictDataset

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = torchdata.StatefulDataLoader

N = 48
# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds")
    list(CacheDataLoader(DictDataset(N), cache_dir=path, chunk_size=4, batch_size=8))
    return path


def make(path, num_workers: int) -> StatefulDataLoader:
    ds = StreamingDataset(path, shuffle=True, seed=11)
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    return StatefulDataLoader(ds, batch_size=4, num_workers=num_workers, **kw)


def keys(batches) -> list[int]:
    return [k for b in batches for k in b["i"].tolist()]


@pytest.mark.parametrize(("num_workers", "stop"), [(0, 5), (2, 3), (2, 7)])
def test_stateful_dataloader_resumes_exactly(written, num_workers, stop):
    reference = keys(make(written, num_workers))
    assert sorted(reference) == list(range(N))
    dl = make(written, num_workers)
    it = iter(dl)
    before = keys(next(it) for _ in range(stop))
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    del it
    again = make(written, num_workers)
    again.load_state_dict(state)
    after = keys(again)
    assert before + after == reference, "exactly the rest of the epoch, in order"
    # The next epoch follows, as in an uninterrupted run.
    whole = make(written, num_workers)
    list(whole)
    assert keys(again) == keys(whole)


def worker_states(state):
    """The StreamingDataset states torchdata saved from its workers."""
    if isinstance(state, dict):
        if "worker" in state and "yielded" in state:
            return [state]
        return [w for v in state.values() for w in worker_states(v)]
    return []


def test_a_worker_state_into_another_worker_count_raises(written):
    dl = make(written, 2)
    it = iter(dl)
    next(it)
    saved = worker_states(dl.state_dict())
    del it
    assert sorted(w["worker"] for w in saved) == [0, 1] and {w["workers"] for w in saved} == {2}
    # Loaded where the worker count differs (here: the main process, worker 0 of 1).
    with pytest.raises(ResumeStateError, match="resume with the same num_workers"):
        StreamingDataset(written, shuffle=True, seed=11).load_state_dict(saved[0])
