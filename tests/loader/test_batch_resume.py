"""Whole batches from the workers resume exactly like the per-item path: stop anywhere
(before the first batch, mid-epoch, after the last, with drop_last), resume in a fresh
loader, and the items are the per-item path's, in order."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, StreamingDataset
from tests.loader.test_batch import Fixed, per_item, write

EPOCHS = 2


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[int, Path] = {}

    def get(n: int) -> Path:
        if n not in done:
            done[n] = write(tmp_path_factory.mktemp(f"fixed{n}"), Fixed(n))
        return done[n]

    return get


def loader(path: Path, bs: int, drop_last: bool, shuffle: bool, workers: int, **kw: Any) -> Any:
    ds = StreamingDataset(path, shuffle=shuffle, seed=5)
    return CacheDataLoader(ds, batch_size=bs, drop_last=drop_last, num_workers=workers, **kw)


def keys(batch: Any) -> list[int]:
    return batch["y"].tolist()


def interrupted(
    path: Path, cfg: dict[str, Any], stop: int, then: int, **kw: Any
) -> tuple[list[int], Any, str | None]:
    """Items of ``stop`` batches, then of a fresh loader (``then`` workers) resumed from
    the state taken there, up to the end of epoch ``EPOCHS - 1``; and the state."""
    dl = loader(path, **cfg, **kw)
    it = iter(dl)
    got: list[int] = []
    for _ in range(stop):
        b = next(it, None)
        if b is None:
            break
        got += keys(b)
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    del it
    again = loader(path, **{**cfg, "workers": then}, **kw)
    again.load_state_dict(state)
    while again.epoch < EPOCHS:
        got += [k for b in again for k in keys(b)]
    return got, state, dl.batch_fallback


def check(path: Path, cfg: dict[str, Any], stop: int, then: int) -> None:
    got, state, fallback = interrupted(path, cfg, stop, then)
    assert fallback is None
    if then == cfg["workers"]:  # the same split: the uninterrupted per-item order
        ref_dl = loader(path, **cfg, collate_fn=per_item)
        ref = [k for _ in range(EPOCHS) for b in ref_dl for k in keys(b)]
        assert got == ref
    else:  # another split of the rest: what the per-item path does, interrupted alike
        ref, ref_state, _ = interrupted(path, cfg, stop, then, collate_fn=per_item)
        assert got == ref and state == ref_state


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.sampled_from([23, 40]),
    bs=st.integers(1, 7),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    stop=st.integers(0, 50),
)
@example(n=23, bs=5, drop_last=True, shuffle=True, stop=0)  # before the first batch
@example(n=23, bs=5, drop_last=True, shuffle=False, stop=4)  # after the last full batch
@example(n=23, bs=5, drop_last=False, shuffle=True, stop=5)  # after the short last batch
def test_resume_anywhere(written, n, bs, drop_last, shuffle, stop):
    cfg = {"bs": bs, "drop_last": drop_last, "shuffle": shuffle, "workers": 0}
    check(written(n), cfg, stop, 0)


def test_resume_from_two_workers_with_none(written):
    cfg = {"bs": 3, "drop_last": True, "shuffle": True, "workers": 2}
    check(written(40), cfg, 5, 0)
