"""Resume states, mutated every way a damaged or foreign checkpoint can be: each either
validates to a state that satisfies every invariant the resume arithmetic relies on
(so it resumes to a well-defined position), or raises ``ResumeStateError`` naming the
field; nothing else escapes, and no check runs past a generous CPU-time limit.

The valid states are made with the library's own arithmetic (``consumed_to_remaining``)
in the shapes ``EpochDataset.state_dict()``, its per-worker form, ``MixedDataset`` and
``CacheDataLoader.state_dict()`` write (tests/loader/test_state_mutations.py loads the
real ones).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccache.errors import ResumeStateError
from asynccache.sampling.partition import consumed_to_remaining, plan
from asynccache.sampling.progress import Progress, worker_part
from asynccache.sampling.state import (
    MAX_INTERVALS,
    MAX_WORK,
    DatasetPosition,
    LoaderPosition,
    check_dataset_state,
    check_loader_state,
    rank_share,
)

CPU_LIMIT_S = 5.0
STREAM = {
    "dataset": "xxh3_64:73056f59471bdfc8",
    "seed": 3,
    "shuffle": True,
    "shuffle_window": 4,
    "subsample": None,
    "epoch_size": None,
    "drop_last": False,
}
TOKENS = {**STREAM, "item_loader": "tokens-128", "shuffle": False}
MIX = {
    "mix": "weight",
    "seed": 5,
    "mix_batch": None,
    "epoch_size": None,
    "drop_last": False,
    "streams": [
        {**STREAM, "weight": 1.0, "repeat": None, "choose": None},
        {**STREAM, "dataset": "xxh3_64:0000000000000abc", "weight": 0.5, "repeat": None,
         "choose": None},
    ],
}  # fmt: skip
IDENTITIES = {"stream": STREAM, "tokens": TOKENS, "mix": MIX}


# -- valid states ------------------------------------------------------------------------
@st.composite
def valid_progress(draw: Any, worker: bool = False) -> tuple[Progress, int, bool]:
    """A position the library could have saved: ``(progress, epoch_total, drop_last)``."""
    total = draw(st.integers(0, 400))
    drop_last = draw(st.booleans())
    remaining: list[tuple[int, int]] | None = [(0, total)] if total else []
    if draw(st.booleans()):  # saved after a resume with another configuration
        before = dict(world=draw(st.integers(1, 4)), num_workers=draw(st.integers(1, 4)),
                      batch_size=draw(st.integers(1, 8)))  # fmt: skip
        share = rank_share(total, before["world"], drop_last)
        got = draw(st.integers(0, share))
        got = share if got > share - before["batch_size"] else got - got % before["batch_size"]
        remaining = consumed_to_remaining(
            remaining or [], drop_last=drop_last, received=got, **before
        )
    if worker and draw(st.booleans()):
        remaining = None
    world, nw, bs = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 8))
    length = total if remaining is None else sum(b - a for a, b in remaining)
    share = rank_share(length, world, drop_last)
    received = draw(st.integers(0, share))
    received = share if received > share - bs else received - received % bs
    rem = None if remaining is None else tuple(remaining)
    return Progress(draw(st.integers(0, 5)), rem, world, nw, bs, received), total, drop_last


def dataset_state(pr: Progress, identity: dict[str, Any]) -> dict[str, Any]:
    """As ``EpochDataset.state_dict()`` writes it."""
    return {
        "version": 1,
        **{k: v for k, v in identity.items() if not (k == "item_loader" and v is None)},
        "epoch": pr.epoch,
        "remaining": None if pr.remaining is None else [list(r) for r in pr.remaining],
        "world": pr.world,
        "num_workers": pr.num_workers,
        "batch_size": pr.batch_size,
        "received": pr.received,
    }


# -- mutations ---------------------------------------------------------------------------
HOSTILE: list[Any] = [
    0, 1, -1, 2, 3, 7, 10**9, 2**31, 2**53 + 1, 2**63, 10**100, -(2**63), 0.0, 1.0, 2.5,
    float("nan"), float("inf"), True, False, None, "", "1", "x" * 200, [], {}, [0], [0, 1],
    [[0, 1]], [[0, 10**12]], [[5, 3]], [[0, 2], [1, 3]], [[0, 1], [0, 1]], {"a": 1},
    np.int64(1), np.float64(1.0), (0, 1), b"1",
]  # fmt: skip


def _paths(node: Any, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield here
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*here, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*here, i))


def _at(doc: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    return parent, path[-1]


@st.composite
def mutated(draw: Any, state: dict[str, Any]) -> Any:
    """``state`` after 1-3 of: set a field to a hostile value, delete it, negate or
    enlarge a number, duplicate or drop a list element, swap two fields' values, add an
    unknown field."""
    doc = copy.deepcopy(state)
    for _ in range(draw(st.integers(1, 3), label="mutations")):
        paths = [p for p in _paths(doc) if p]
        op = draw(st.sampled_from(
            ["set", "set", "delete", "negate", "enlarge", "duplicate", "swap", "add", "root"]
        ), label="op")  # fmt: skip
        if op == "root":
            doc = draw(st.sampled_from(HOSTILE), label="root")
            continue
        if not isinstance(doc, dict) or not paths:
            break
        path = draw(st.sampled_from(paths), label="path")
        parent, key = _at(doc, path)
        if op == "set":
            parent[key] = copy.deepcopy(draw(st.sampled_from(HOSTILE), label="value"))
        elif op == "delete":
            del parent[key]
        elif op in ("negate", "enlarge") and isinstance(parent[key], int):
            v = parent[key]
            parent[key] = -v - 1 if op == "negate" else v * 10 ** draw(st.integers(1, 30)) + 1
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif op == "swap":
            other = draw(st.sampled_from(paths), label="with")
            p2, k2 = _at(doc, other)
            with contextlib.suppress(KeyError, IndexError, TypeError):
                parent[key], p2[k2] = p2[k2], parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "rank", "epoch_"]))] = 1
    return doc


# -- the oracle --------------------------------------------------------------------------
class _CpuLimit(Exception):
    pass


@contextlib.contextmanager
def cpu_limit(seconds: float = CPU_LIMIT_S) -> Iterator[None]:
    """Raise _CpuLimit after ``seconds`` of this process's CPU time (SIGVTALRM: not the
    SIGALRM pytest-timeout uses), so a wall-clock hiccup never fails a test."""

    def fire(signum: int, frame: Any) -> None:
        raise _CpuLimit

    old = signal.signal(signal.SIGVTALRM, fire)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, old)


def judged(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)``'s result, or None when it refused with ResumeStateError that
    names a field of the state; anything else (another exception, too much CPU) fails."""
    try:
        with cpu_limit():
            return fn(*args, **kw)
    except ResumeStateError as exc:
        assert "state" in str(exc), exc
        return None
    except _CpuLimit:
        pytest.fail(f"validation ran past {CPU_LIMIT_S}s of CPU")


def assert_resumable(pr: Progress, total: int, drop_last: bool) -> None:
    """``pr`` holds every invariant, and resuming it (same configuration, and another)
    reads each remaining position at most once, all within the epoch."""
    assert type(pr.epoch) is int and pr.epoch >= 0
    for v in (pr.world, pr.num_workers, pr.batch_size):
        assert type(v) is int and v >= 1
    ivs = pr.base(total)
    assert len(ivs) <= MAX_INTERVALS
    assert all(type(a) is int and type(b) is int and 0 <= a < b <= total for a, b in ivs)
    assert all(b0 <= a1 for (_, b0), (a1, _) in itertools.pairwise(ivs))
    assert pr.world * (32 * pr.num_workers + len(ivs)) <= MAX_WORK
    share = rank_share(sum(b - a for a, b in ivs), pr.world, drop_last)
    assert type(pr.received) is int and 0 <= pr.received <= share
    assert pr.received % pr.batch_size == 0 or pr.received == share
    if pr.world > 16:  # (the arithmetic below is the library's: only its cost is checked)
        with cpu_limit():
            pr.left(total, drop_last)
        return
    allowed = {p for a, b in ivs for p in range(a, b)}
    for world, nw, bs in ((pr.world, pr.num_workers, pr.batch_size), (2, 3, 2)):
        q = pr.adapted(world, nw, bs, total, drop_last)
        seen: list[int] = []
        for rank in range(world):
            p = plan(q.base(total), world=world, rank=rank, num_workers=nw, batch_size=bs,
                     drop_last=drop_last)  # fmt: skip
            for w in range(nw):
                part = worker_part(q, p, worker=w)
                seen += [x for s in part.segments if not s.pad for x in range(s.start, s.end)]
        assert len(seen) == len(set(seen)), "a position would be read twice"
        assert set(seen) <= allowed, "a position outside what the state left"


# -- properties --------------------------------------------------------------------------
PROFILE = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@PROFILE
@given(data=st.data(), kind=st.sampled_from(sorted(IDENTITIES)))
def test_mutated_dataset_states_validate_or_are_refused(data: Any, kind: str) -> None:
    pr, total, drop_last = data.draw(valid_progress())
    identity = IDENTITIES[kind]
    state = dataset_state(pr, identity)
    ok = judged(check_dataset_state, state, identity=identity, epoch_total=total,
                drop_last=drop_last, worker_state=False)  # fmt: skip
    assert ok == DatasetPosition(pr), "a valid state was refused or changed"
    bad = data.draw(mutated(state))
    got = judged(check_dataset_state, bad, identity=identity, epoch_total=total,
                 drop_last=drop_last, worker_state=False)  # fmt: skip
    if got is not None:
        assert got.worker is None
        assert_resumable(got.progress, total, drop_last)


@PROFILE
@given(data=st.data())
def test_mutated_worker_states_validate_or_are_refused(data: Any) -> None:
    pr, total, drop_last = data.draw(valid_progress(worker=True))
    workers = data.draw(st.integers(1, 4))
    length = total if pr.remaining is None else sum(b - a for a, b in pr.remaining)
    state = {**dataset_state(pr, STREAM), "worker": data.draw(st.integers(0, workers - 1)),
             "workers": workers,
             "yielded": data.draw(st.integers(0, rank_share(length, pr.world, drop_last)))}  # fmt: skip
    ok = judged(check_dataset_state, state, identity=STREAM, epoch_total=total,
                drop_last=drop_last, worker_state=True)  # fmt: skip
    assert ok is not None and ok.progress == pr and ok.worker == state["worker"]
    got = judged(check_dataset_state, data.draw(mutated(state)), identity=STREAM,
                 epoch_total=total, drop_last=drop_last)  # fmt: skip
    if got is not None:
        assert_resumable(got.progress, total, drop_last)
        if got.worker is not None:
            assert got.workers is not None and 0 <= got.worker < got.workers
            assert got.yielded is not None and got.yielded >= 0


@PROFILE
@given(data=st.data(), writing=st.booleans())
def test_mutated_loader_states_validate_or_are_refused(data: Any, writing: bool) -> None:
    pr, total, drop_last = data.draw(valid_progress())
    base = {"version": 1, "epoch": pr.epoch, "batches": data.draw(st.integers(0, 50)),
            "world": pr.world, "num_workers": pr.num_workers, "batch_size": pr.batch_size,
            "writing": writing}  # fmt: skip
    if data.draw(st.booleans(), label="skips"):  # steps skip() dropped
        base["skips"] = [[3, 5], [9, 10]]
    if writing:
        state = {**base, "items": total, "seed": 11, "shuffle": False, "drop_last": drop_last,
                 "source": data.draw(st.sampled_from(["map", "iterable"]))}  # fmt: skip
    else:  # a scheduled mix's stream state carries its layout (the mix checks it)
        state = {**base, "stream": {**dataset_state(pr, STREAM), "layout": [1, 1, 4, False]}}
    kw = dict(identity=STREAM, epoch_total=total, drop_last=drop_last, seed=11, shuffle=False,
              extra=("layout", "schedule_digest"))  # fmt: skip
    ok = judged(check_loader_state, state, **kw)
    assert isinstance(ok, LoaderPosition) and ok.state == state
    got = judged(check_loader_state, data.draw(mutated(state)), **kw)
    if got is None:
        return
    assert got.writing == (got.stream is None)
    if got.stream is not None:
        assert got.stream.progress.epoch == got.epoch
        assert_resumable(got.stream.progress, total, drop_last)
    # What it keeps is itself a valid state of the same meaning.
    again = judged(check_loader_state, got.state, **kw)
    assert again == got


# -- examples: what a checkpoint that is not this dataset's looks like -------------------
def _state(**changes: Any) -> dict[str, Any]:
    return {**dataset_state(Progress(1, ((0, 100),), 2, 2, 4, 8), STREAM), **changes}


def _check(state: Any, total: int = 100) -> DatasetPosition:
    return check_dataset_state(state, identity=STREAM, epoch_total=total, drop_last=False)


@pytest.mark.parametrize(
    "changes, path",
    [
        ({"received": -4}, "state['received']"),
        ({"received": 12.0}, "state['received']"),
        ({"received": True}, "state['received']"),
        ({"received": 6}, "state['received']"),  # half a batch: would replay it
        ({"received": 60}, "state['received']"),  # more than the rank's 50
        ({"remaining": [[0, 60], [50, 100]]}, r"state['remaining'][1][0]"),
        ({"remaining": [[0, 101]]}, r"state['remaining'][0][1]"),
        ({"remaining": [[30, 30]]}, r"state['remaining'][0]"),
        ({"remaining": [[0, "9"]]}, r"state['remaining'][0][1]"),
        ({"remaining": 7}, "state['remaining']"),
        ({"world": 10**9}, "state['world']"),
        ({"world": 0}, "state['world']"),
        ({"num_workers": 10**12}, "state['num_workers']"),
        ({"world": 4096, "num_workers": 1024}, "state['world']"),
        ({"epoch": -1}, "state['epoch']"),
        ({"epoch": 2**70}, "state['epoch']"),
        ({"shuffle": 1}, "state['shuffle']"),
        ({"seed": 4}, "state['seed']"),
        ({"seed": 3.0}, "state['seed']"),
        ({"dataset": "xxh3_64:0000000000000000"}, "state['dataset']"),
        ({"item_loader": "tokens-64"}, "state['item_loader']"),
        ({"rank": 0}, "state['rank']"),
        ({"version": 2}, "state['version']"),
    ],
)
def test_each_fault_is_refused_naming_its_field(changes: dict[str, Any], path: str) -> None:
    with pytest.raises(ResumeStateError) as got:
        _check(_state(**changes))
    assert path in str(got.value)


@pytest.mark.parametrize("key", ["epoch", "remaining", "world", "received", "seed", "dataset"])
def test_a_missing_field_is_refused_naming_it(key: str) -> None:
    state = _state()
    del state[key]
    with pytest.raises(ResumeStateError, match=rf"state\['{key}'\]"):
        _check(state)


def test_same_meaning_in_other_clothes_validates_the_same() -> None:
    """numpy integers and tuples (a checkpoint round trip may make them) are the state."""
    want = _check(_state())
    again = _check(_state(remaining=((np.int64(0), np.int64(100)),), world=np.int32(2)))
    assert again == want and type(again.progress.world) is int


def test_a_huge_claimed_count_costs_nothing() -> None:
    """No check loops over a number the state gives: a world of 2**16 ranks with a
    billion-position epoch is judged in microseconds (counted, not timed: the checks
    are bounded by the state's size, one interval here)."""
    state = _state(world=1 << 16, num_workers=1, remaining=[[0, 10**9]], received=0)
    got = judged(_check, state, 10**9)
    assert got is not None and got.progress.world == 1 << 16


def test_a_worker_state_must_be_of_a_worker_of_the_loader() -> None:
    state = {**_state(), "worker": 3, "workers": 2, "yielded": 0}
    with pytest.raises(ResumeStateError, match=r"state\['worker'\]"):
        _check(state)


def test_a_loader_state_whose_epochs_disagree_is_refused() -> None:
    stream = _state()
    state = {"version": 1, "epoch": 2, "batches": 2, "world": 2, "num_workers": 2,
             "batch_size": 4, "writing": False, "stream": stream}  # fmt: skip
    with pytest.raises(ResumeStateError, match=r"state\['epoch'\]"):
        check_loader_state(state, identity=STREAM, epoch_total=100, drop_last=False, seed=0,
                           shuffle=False)  # fmt: skip
    with pytest.raises(ResumeStateError, match=r"state\['stream'\]\['received'\]"):
        check_loader_state({**state, "epoch": 1, "stream": {**stream, "received": -8}},
                           identity=STREAM, epoch_total=100, drop_last=False, seed=0,
                           shuffle=False)  # fmt: skip


def test_skips_are_checked_and_the_datasets_own_fields_kept() -> None:
    stream = {**_state(), "layout": [2, 2, 4, False]}
    state = {"version": 1, "epoch": 1, "batches": 2, "world": 2, "num_workers": 2,
             "batch_size": 4, "writing": False, "stream": stream, "skips": [[1, 3]]}  # fmt: skip
    kw = dict(identity=STREAM, epoch_total=100, drop_last=False, seed=0, shuffle=False)
    got = check_loader_state(state, **kw, extra=("layout",))
    assert got.skips is not None and got.skips.to_json() == [[1, 3]]
    assert got.state == state  # the layout travels on, for the mix to check
    with pytest.raises(ResumeStateError, match=r"state\['stream'\]\['layout'\]"):
        check_loader_state(state, **kw)  # a dataset without such a field
    with pytest.raises(ResumeStateError, match=r"state\['skips'\]"):
        check_loader_state({**state, "skips": [[3, 1]]}, **kw, extra=("layout",))
    with pytest.raises(ResumeStateError, match=r"state\['skips'\]"):
        check_loader_state({**state, "skips": [[True, 2]]}, **kw, extra=("layout",))
