"""Damaged checkpoints through the real ``load_state_dict``: each mutated state either
resumes exactly, or is refused at once with ``ResumeStateError``.

Real states are taken from a ``StreamingDataset`` iterated directly (and its per-worker
form), and from ``CacheDataLoader`` (streamed epochs, one saved with two DataLoader
workers, and the writing epoch), then mutated as tests/sampling/test_state.py mutates
them (fields deleted, retyped, negated, enlarged, duplicated, swapped, added). Loading
one must either raise ResumeStateError (nothing else, within a CPU-time limit, before
any sample is read), or resume:

* a state of the same meaning (the same values, however typed: numpy ints, tuples)
  resumes exactly like the original, which continues the uninterrupted run;
* a state of another meaning that was accepted is a position the library could have
  written: the rest of its epoch reads each sample at most once, only this epoch's,
  and the epoch after it is the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.errors import ResumeStateError
from tests.loader.datasets import DictDataset
from tests.sampling.test_state import cpu_limit, mutated

N, CHUNK, BS, SEED = 23, 5, 4, 3
pytestmark = pytest.mark.timeout(900)
# No shrinking: each example opens a dataset and reads an epoch or two, and a failure's
# first example already names the state (shrinking one took minutes).
PROFILE = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("written")
    list(CacheDataLoader(DictDataset(N), cache_dir=path, chunk_size=CHUNK))
    return path


def _keys(batch: Any) -> list[int]:
    i = batch["i"]
    return [int(i)] if np.ndim(i) == 0 else [int(k) for k in i.tolist()]


def canonical(value: Any) -> Any:
    """The value with numpy scalars as Python ones and tuples as lists (what a
    checkpoint round trip may change without changing the meaning)."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def same_meaning(a: Any, b: Any) -> bool:
    """Equal after :func:`canonical`, a bool never equal to a number."""
    a, b = canonical(a), canonical(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_meaning(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_meaning(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@contextlib.contextmanager
def bounded(extra_bytes: int = 1 << 30) -> Iterator[None]:
    """At most ``extra_bytes`` more address space and :data:`CPU_LIMIT_S` of CPU for
    what runs inside: a state that asks for a plan of 10**30 workers ends in a
    MemoryError (a failure of this test) instead of exhausting the machine."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
    try:
        with cpu_limit():
            yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def loaded(target: Any, state: Any) -> bool:
    """Load ``state``: True when accepted, False when refused with ResumeStateError;
    anything else, or more than the CPU-time or memory bound, fails the test."""
    try:
        with bounded():
            target.load_state_dict(state)
    except ResumeStateError:
        return False
    return True


# -- the dataset, iterated directly -------------------------------------------------------
@contextlib.contextmanager
def dataset(written: Path) -> Iterator[StreamingDataset]:
    ds = StreamingDataset(str(written), shuffle=True, seed=SEED)
    try:
        yield ds
    finally:
        ds.close()


def ds_epochs(ds: StreamingDataset, epochs: int) -> list[list[int]]:
    return [[k for item in ds for k in _keys(item)] for _ in range(epochs)]


@pytest.fixture(scope="module")
def ds_reference(written: Path) -> list[list[int]]:
    """Epochs 0, 1 and 2, uninterrupted."""
    with dataset(written) as ds:
        return ds_epochs(ds, 3)


def continues(ref: list[list[int]], done: int, got: list[list[int]]) -> bool:
    """``got`` (epochs run after a resume) is what the uninterrupted run ``ref`` yields
    after its first ``done`` samples."""
    flat = [k for e in ref for k in e]
    rest = [k for e in got for k in e]
    return rest == flat[done : done + len(rest)]


def one_epoch_at_most_once(got: list[list[int]], ref: list[list[int]]) -> bool:
    """The resumed epoch (the state's, or the next when the state's was over) reads no
    sample twice, and only samples of the dataset."""
    return len(got[0]) == len(set(got[0])) and set(got[0]) <= set(range(N))


def ds_state(written: Path, k: int) -> dict[str, Any]:
    with dataset(written) as ds:
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = pickle.loads(pickle.dumps(ds.state_dict()))
        it.close()
    return state


def ds_resumed(written: Path, state: Any) -> list[list[int]] | None:
    """The rest of the state's epoch and the next epoch; None when refused."""
    with dataset(written) as ds:
        if not loaded(ds, state):
            return None
        with bounded():
            return ds_epochs(ds, 2)


@PROFILE
@given(k=st.integers(0, N), data=st.data())
def test_mutated_dataset_states_resume_exactly_or_are_refused(
    written: Path, ds_reference: list[list[int]], k: int, data: Any
) -> None:
    state = ds_state(written, k)
    rest = ds_resumed(written, state)
    assert rest is not None and continues(ds_reference, k, rest), "the original resumes"
    bad = data.draw(mutated(state))
    got = ds_resumed(written, bad)
    if got is None:
        return
    if same_meaning(bad, state):
        assert got == rest
    else:
        assert one_epoch_at_most_once(got, ds_reference)
        received = bad.get("received")
        only_received = isinstance(received, int) and not isinstance(received, bool)
        if only_received and same_meaning({**bad, "received": state["received"]}, state):
            assert continues(ds_reference, received, got)


def worker_state(state: dict[str, Any], yielded: int) -> dict[str, Any]:
    """The per-worker form a stateful DataLoader saves (worker 0 of 1: this process)."""
    return {**state, "remaining": None, "received": 0, "worker": 0, "workers": 1,
            "yielded": yielded}  # fmt: skip


@PROFILE
@given(k=st.integers(0, N), data=st.data())
def test_mutated_worker_states_resume_exactly_or_are_refused(
    written: Path, ds_reference: list[list[int]], k: int, data: Any
) -> None:
    state = worker_state(ds_state(written, 0), k)
    rest = ds_resumed(written, state)
    assert rest is not None and rest[0] == ds_reference[0][k:], "the original resumes"
    bad = data.draw(mutated(state))
    got = ds_resumed(written, bad)
    if got is None:
        return
    if same_meaning(bad, state):
        assert got == rest
    else:
        assert one_epoch_at_most_once(got, ds_reference)


# -- CacheDataLoader ----------------------------------------------------------------------
def loader(path: Path, workers: int = 0, drop_last: bool = False) -> CacheDataLoader:
    return CacheDataLoader(str(path), batch_size=BS, num_workers=workers, shuffle=True,
                           seed=SEED, drop_last=drop_last)  # fmt: skip


def dl_epochs(dl: CacheDataLoader, epochs: int) -> list[list[int]]:
    return [[k for b in dl for k in _keys(b)] for _ in range(epochs)]


@pytest.fixture(scope="module")
def dl_reference(written: Path) -> dict[bool, list[list[int]]]:
    """Epochs 0, 1 and 2 of the loader, uninterrupted, with and without drop_last."""
    return {drop: dl_epochs(loader(written, drop_last=drop), 3) for drop in (False, True)}


def dl_state(path: Path, k: int, workers: int = 0, drop_last: bool = False) -> dict[str, Any]:
    dl = loader(path, workers, drop_last)
    it = iter(dl)
    for _ in range(k):
        next(it)
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    it.close()
    return state


@pytest.fixture(scope="module")
def two_worker_states(written: Path) -> list[tuple[dict[str, Any], list[int]]]:
    """States a loader with two DataLoader workers saved after 0..all batches of epoch
    0, each with the samples received until then (one run)."""
    dl = loader(written, workers=2)
    it = iter(dl)
    got: list[int] = []
    out = [(pickle.loads(pickle.dumps(dl.state_dict())), [])]
    for batch in it:
        got += _keys(batch)
        out.append((pickle.loads(pickle.dumps(dl.state_dict())), list(got)))
    return out


def dl_resumed(path: Path, state: Any, drop_last: bool = False) -> list[list[int]] | None:
    dl = loader(path, drop_last=drop_last)
    if not loaded(dl, state):
        return None
    with bounded():
        return dl_epochs(dl, 2)


@PROFILE
@given(data=st.data(), drop_last=st.booleans(), from_workers=st.booleans())
def test_mutated_loader_states_resume_exactly_or_are_refused(
    written: Path,
    dl_reference: dict[bool, list[list[int]]],
    two_worker_states: list[tuple[dict[str, Any], list[int]]],
    data: Any,
    drop_last: bool,
    from_workers: bool,
) -> None:
    ref = dl_reference[drop_last]
    batches = len(ref[0]) // BS + (0 if drop_last else bool(len(ref[0]) % BS))
    k = data.draw(st.integers(0, batches), label="batches before the stop")
    if from_workers and not drop_last:
        state, before = copy.deepcopy(two_worker_states[k][0]), two_worker_states[k][1]
    else:
        state, before = dl_state(written, k, drop_last=drop_last), ref[0][: k * BS]
    rest = dl_resumed(written, state, drop_last)
    assert rest is not None, "the original resumes"
    if before == ref[0][: len(before)]:  # the same order so far: the same continuation
        assert continues(ref, len(before), rest)
    else:  # two workers' order, continued by one: every sample of the epoch once
        epoch_done = len(before) == len(ref[0])
        assert sorted(before + ([] if epoch_done else rest[0])) == sorted(ref[0])
    bad = data.draw(mutated(state))
    got = dl_resumed(written, bad, drop_last)
    if got is None:
        return
    if same_meaning(bad, state):
        assert got == rest
    else:
        assert one_epoch_at_most_once(got, ref)


@PROFILE
@given(data=st.data(), k=st.integers(0, 3))
def test_mutated_writing_epoch_states_resume_exactly_or_are_refused(
    tmp_path_factory: pytest.TempPathFactory, data: Any, k: int
) -> None:
    """The writing epoch (a map-style dataset written into the cache as it is read)."""

    def make() -> CacheDataLoader:
        return CacheDataLoader(DictDataset(N), cache_dir=tmp_path_factory.mktemp("w"),
                               batch_size=BS, chunk_size=CHUNK)  # fmt: skip

    ref = [k2 for b in make() for k2 in _keys(b)]
    dl = make()
    it = iter(dl)
    for _ in range(k):
        next(it)
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    it.close()
    bad = data.draw(mutated(state))
    fresh = make()
    if not loaded(fresh, bad):
        return
    with bounded():
        got = [k2 for b in fresh for k2 in _keys(b)]
    if same_meaning(bad, state):
        assert got == ref[k * BS :]
    else:
        assert len(got) == len(set(got)) and set(got) <= set(ref)


# -- examples the properties found on the code before validation --------------------------
@pytest.mark.parametrize(
    "change",
    [
        {"received": -4},  # replayed samples already received
        {"received": 6},  # half a batch: replayed its first half
        {"remaining": [[0, 12], [8, 23]]},  # overlapping: replayed 8..11
        {"remaining": [[0, 30]]},  # past the epoch
        {"world": 10**9},  # one plan per rank: ran for minutes
        {"num_workers": 10**8},  # one span per worker: gigabytes, then MemoryError
        {"epoch": -1},
        {"epoch": "1"},
        {"remaining": [[0, "23"]]},
        {"seed": True},
        {"shuffle": 1},
    ],
)
def test_each_damage_is_refused_at_load(written: Path, change: dict[str, Any]) -> None:
    state = dl_state(written, 2)
    state["stream"].update(change)
    with pytest.raises(ResumeStateError), bounded():
        loader(written).load_state_dict(state)
