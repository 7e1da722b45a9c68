"""Resume states checked whole before anything uses them. Pure: no torch, no I/O.

A state is input: a checkpoint may be damaged, edited, or from another dataset. Its
numbers size loops (one rank's plan per ``world``, one span per worker), seed random
orders and pick the positions a loader reads next, so a wrong one could hang, exhaust
memory, or silently replay or skip samples. The functions here take a state as the
library writes it (the dataset form of ``StreamingDataset`` / ``MixedDataset``
``state_dict()``, the per-worker form a stateful ``DataLoader`` saves, and
``CacheDataLoader.state_dict()``) together with what the dataset knows (its identity,
its epoch length, ``drop_last``), and return the position it describes, or raise
:class:`~asynccache.errors.ResumeStateError` naming the first field at fault as a path
(``state['remaining'][3][1]``).

What a valid state satisfies (the invariants the resume arithmetic of :mod:`.progress`
and :mod:`.partition` relies on):

* the schema: exactly the known keys (and the further fields a dataset names as its
  own, which it checks itself), each of its type; counts are real ints (not
  bools, not floats) within bounds (:data:`MAX_EPOCH`, :data:`MAX_WORLD`,
  :data:`MAX_WORKERS`, :data:`MAX_BATCH`);
* the identity (dataset checksum, seed, shuffle, ...) equals the dataset's, with the
  same types (``True`` is not ``1``);
* ``remaining``: at most :data:`MAX_INTERVALS` intervals ``[a, b)`` with
  ``0 <= a < b <= epoch_total``, sorted and disjoint;
* ``received`` (per rank, whole batches): at most the rank's share of ``remaining``,
  and a multiple of ``batch_size`` unless it is that whole share (a short last batch);
* the resume arithmetic the state asks for is bounded: ``world * (32 * num_workers +
  len(remaining))`` at most :data:`MAX_WORK` (a few seconds of the library's own
  planning, far above any real job's).

Invariant of this module: the work of every check is bounded by the size of the state
as given (its lists and dicts), never by a number it states.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..errors import ResumeStateError
from .progress import Progress
from .steps import Skips

__all__ = [
    "MAX_BATCH",
    "MAX_EPOCH",
    "MAX_INTERVALS",
    "MAX_WORK",
    "MAX_WORKERS",
    "MAX_WORLD",
    "STATE_VERSION",
    "DatasetPosition",
    "LoaderPosition",
    "check_dataset_state",
    "check_loader_state",
    "rank_share",
]

STATE_VERSION = 1
#: Bounds on what a state may say (each far above any real job).
MAX_EPOCH = 1 << 53
MAX_WORLD = 1 << 16
MAX_WORKERS = 1 << 10
MAX_BATCH = 1 << 31
MAX_INTERVALS = 1 << 18
#: Bound on the planning a state asks for: ``world * (32 * num_workers + intervals)``
#: (about 2 s of :meth:`Progress.left` on a slow core; a 1,024-rank job with 8 workers
#: and 8,192 intervals left asks for half of it).
MAX_WORK = 1 << 24
#: Bound on a count a state carries (positions, samples, batches).
MAX_COUNT = 1 << 62

_DATASET_KEYS = ("version", "epoch", "remaining", "world", "num_workers", "batch_size", "received")
_WORKER_KEYS = ("worker", "workers", "yielded")
_LOADER_KEYS = (
    "version", "epoch", "batches", "world", "num_workers", "batch_size", "writing", "skips"
)  # fmt: skip
_WRITING_KEYS = ("items", "seed", "shuffle", "drop_last", "source")


@dataclasses.dataclass(frozen=True)
class DatasetPosition:
    """A validated dataset state: its :class:`Progress`, and for a single DataLoader
    worker's state, which worker of how many saved it and how many of its own part's
    positions it had yielded (``worker`` None: the whole rank's state)."""

    progress: Progress
    worker: int | None = None
    workers: int | None = None
    yielded: int | None = None


@dataclasses.dataclass(frozen=True)
class LoaderPosition:
    """A validated ``CacheDataLoader`` state.

    ``stream``: the dataset position of a streamed epoch (None for a writing epoch);
    ``items``, ``source``: a writing epoch's item count (None: unknown) and source kind.
    ``skips``: the skipped step ranges it carries (None: none).
    ``state``: the state, normalised (plain ints, lists), to keep and hand back.
    """

    epoch: int
    batches: int
    world: int
    num_workers: int
    batch_size: int
    writing: bool
    stream: DatasetPosition | None
    items: int | None
    source: str | None
    skips: Skips | None
    state: dict[str, Any]


# -- the checks --------------------------------------------------------------------
def _fail(path: str, why: str, name: str) -> ResumeStateError:
    return ResumeStateError(f"{name}: {path} {why}" if name else f"{path} {why}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(state: Mapping[str, Any], key: str, path: str, lo: int, hi: int, name: str) -> int:
    if key not in state:
        raise _fail(f"{path}[{key!r}]", "is missing", name)
    return _int_value(state[key], f"{path}[{key!r}]", lo, hi, name)


def _int_value(v: Any, path: str, lo: int, hi: int, name: str) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise _fail(path, f"must be an integer, got {_shown(v)}", name)
    v = int(v)
    if not lo <= v <= hi:
        raise _fail(path, f"must be from {lo} to {hi}, got {_shown(v)}", name)
    return v


def _keys(state: Any, path: str, known: tuple[str, ...], name: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise _fail(path, f"must be a dict, got {type(state).__name__}", name)
    for key in state:
        if key not in known:
            raise _fail(f"{path}[{key!r}]", "is not a field of this state", name)
    return state


def _same(theirs: Any, mine: Any) -> bool:
    """``theirs`` equals ``mine`` (the dataset's own identity value) with the same
    kinds of values: a bool is not a number, a list or tuple compares item by item, a
    dict key by key. Work bounded by the sizes of both."""
    if isinstance(mine, (bool, np.bool_)) or isinstance(theirs, (bool, np.bool_)):
        return (
            isinstance(mine, (bool, np.bool_))
            and isinstance(theirs, (bool, np.bool_))
            and bool(mine) == bool(theirs)
        )
    if mine is None or theirs is None:
        return mine is None and theirs is None
    if isinstance(mine, str) or isinstance(theirs, str):
        return isinstance(mine, str) and isinstance(theirs, str) and mine == theirs
    if isinstance(mine, (int, np.integer)):  # a count or a seed: an int, exactly
        return isinstance(theirs, (int, np.integer)) and int(theirs) == int(mine)
    if isinstance(mine, (float, np.floating)):  # a weight: 1 and 1.0 are the same
        return (
            isinstance(theirs, (int, float, np.integer, np.floating))
            and math.isfinite(float(theirs)) == math.isfinite(float(mine))
            and theirs == mine
        )
    if isinstance(mine, Mapping):
        return (
            isinstance(theirs, Mapping)
            and len(theirs) == len(mine)
            and all(k in theirs and _same(theirs[k], v) for k, v in mine.items())
        )
    if isinstance(mine, (list, tuple)):
        return (
            isinstance(theirs, (list, tuple))
            and len(theirs) == len(mine)
            and all(_same(a, b) for a, b in zip(theirs, mine, strict=True))
        )
    return bool(theirs == mine)


def _difference(theirs: Any, mine: Any, path: str) -> tuple[str, Any, Any] | None:
    """Where ``theirs`` first differs from ``mine`` (:func:`_same`): the deepest path
    into dicts and lists of the same shape, and the two values there; None if equal."""
    if _same(theirs, mine):
        return None
    if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
        for k, v in mine.items():
            if k not in theirs:
                return f"{path}[{k!r}]", "<missing>", v
            got = _difference(theirs[k], v, f"{path}[{k!r}]")
            if got is not None:
                return got
        extra = next((k for k in theirs if k not in mine), None)
        return f"{path}[{extra!r}]", theirs.get(extra), "<no such field>"
    lists = isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple))
    if lists and len(theirs) == len(mine):
        for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
            got = _difference(a, b, f"{path}[{i}]")
            if got is not None:
                return got
    return path, theirs, mine


def _identity(state: Mapping[str, Any], identity: Mapping[str, Any], path: str, name: str) -> None:
    for key, mine in identity.items():
        if key not in state and mine is None:
            continue  # a fact this dataset doesn't have (e.g. no item_loader)
        if key not in state:
            raise _fail(f"{path}[{key!r}]", f"is missing (this dataset has {_shown(mine)})", name)
        diff = _difference(state[key], mine, f"{path}[{key!r}]")
        if diff is not None:
            where, theirs, ours = diff
            raise _fail(
                where,
                f"is {_shown(theirs)}, this dataset has {_shown(ours)}: the state is of "
                "another dataset or order and can't continue this one",
                name,
            )


def _intervals(raw: Any, path: str, total: int, name: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(raw, (list, tuple)):
        raise _fail(path, f"must be a list of [start, end] intervals, got {_shown(raw)}", name)
    if len(raw) > MAX_INTERVALS:
        raise _fail(path, f"holds {len(raw)} intervals, more than {MAX_INTERVALS}", name)
    out: list[tuple[int, int]] = []
    end = 0
    for i, iv in enumerate(raw):
        here = f"{path}[{i}]"
        if not isinstance(iv, (list, tuple)) or len(iv) != 2:
            raise _fail(here, f"must be a [start, end] pair, got {_shown(iv)}", name)
        a = _int_value(iv[0], f"{here}[0]", 0, total, name)
        b = _int_value(iv[1], f"{here}[1]", 0, total, name)
        if a >= b:
            raise _fail(here, f"is empty or reversed: [{a}, {b})", name)
        if a < end:
            raise _fail(
                f"{here}[0]",
                f"is {a}, before the end {end} of the interval before it: the intervals "
                "must be sorted and disjoint",
                name,
            )
        out.append((a, b))
        end = b
    return tuple(out)


def rank_share(length: int, world: int, drop_last: bool) -> int:
    """Samples each rank receives of an epoch part of ``length`` positions."""
    return length // world if drop_last else -(-length // world)


def check_dataset_state(
    state: Any,
    *,
    identity: Mapping[str, Any],
    epoch_total: int,
    drop_last: bool,
    name: str = "",
    path: str = "state",
    worker_state: bool | None = None,
    extra: Collection[str] = (),
) -> DatasetPosition:
    """The position a dataset state describes (``EpochDataset.state_dict()``, or a
    DataLoader worker's own: ``worker_state`` None accepts either, else only that form).

    Args:
        state: the state as loaded from a checkpoint.
        identity: the dataset's identity (``identity()``; a None value may be absent).
        epoch_total: positions of one epoch of this dataset (all ranks).
        drop_last: the dataset's ``drop_last``.
        name: the dataset, for messages; path: the state's own name in them.
        extra: further fields this dataset writes and checks itself (a scheduled mix's
            ``layout`` and ``schedule_digest``): allowed here, not judged.

    Raises:
        ResumeStateError: naming the first field at fault.
    """
    is_worker = isinstance(state, Mapping) and "worker" in state
    if worker_state is not None and is_worker != worker_state:
        what = "a DataLoader worker's own state" if is_worker else "a whole rank's state"
        raise _fail(path, f"is {what}, which can't be loaded here", name)
    known = _DATASET_KEYS + tuple(identity) + (_WORKER_KEYS if is_worker else ()) + tuple(extra)
    st = _keys(state, path, known, name)
    if "version" not in st or type(st["version"]) is not int or st["version"] != STATE_VERSION:
        raise _fail(
            f"{path}['version']", f"must be {STATE_VERSION}, got {_shown(st.get('version'))}", name
        )
    _identity(st, identity, path, name)
    epoch = _int(st, "epoch", path, 0, MAX_EPOCH, name)
    world = _int(st, "world", path, 1, MAX_WORLD, name)
    nw = _int(st, "num_workers", path, 1, MAX_WORKERS, name)
    bs = _int(st, "batch_size", path, 1, MAX_BATCH, name)
    if "remaining" not in st:
        raise _fail(f"{path}['remaining']", "is missing", name)
    raw = st["remaining"]
    remaining = (
        None
        if raw is None and is_worker
        else _intervals(raw, f"{path}['remaining']", epoch_total, name)
    )
    intervals = 1 if remaining is None else len(remaining)
    if world * (32 * nw + intervals) > MAX_WORK:
        raise _fail(
            f"{path}['world']",
            f"is {world} with num_workers {nw} and {intervals} intervals: resuming it would "
            f"plan more than {MAX_WORK} steps (world * (32 * num_workers + intervals))",
            name,
        )
    length = epoch_total if remaining is None else sum(b - a for a, b in remaining)
    share = rank_share(length, world, drop_last)
    received = _int(st, "received", path, 0, share, name)
    if received % bs and received != share:
        raise _fail(
            f"{path}['received']",
            f"is {received}: not whole batches of {bs}, nor the rank's whole share {share}",
            name,
        )
    pr = Progress(epoch, remaining, world, nw, bs, received)
    if not is_worker:
        return DatasetPosition(pr)
    workers = _int(st, "workers", path, 1, MAX_WORKERS, name)
    w = _int(st, "worker", path, 0, workers - 1, name)
    yielded = _int(st, "yielded", path, 0, share, name)
    return DatasetPosition(pr, w, workers, yielded)


def check_loader_state(
    state: Any,
    *,
    identity: Mapping[str, Any] | None,
    epoch_total: int | None,
    drop_last: bool,
    seed: int,
    shuffle: bool,
    name: str = "",
    extra: Collection[str] = (),
) -> LoaderPosition:
    """The position a ``CacheDataLoader`` state describes.

    Args:
        identity, epoch_total: of the dataset its streamed epochs read (None when the
            loader has none yet: a streamed state is then refused).
        drop_last, seed, shuffle: the loader's, which a writing epoch's state must match.
        extra: the streamed dataset's own further fields (see :func:`check_dataset_state`).

    Raises:
        ResumeStateError: naming the first field at fault.
    """
    path = "state"
    writing_keys = _WRITING_KEYS if isinstance(state, Mapping) and state.get("writing") else ()
    stream_key = () if writing_keys else ("stream",)
    st = _keys(state, path, _LOADER_KEYS + writing_keys + stream_key, name)
    if "version" not in st or type(st["version"]) is not int or st["version"] != STATE_VERSION:
        raise _fail(
            f"{path}['version']", f"must be {STATE_VERSION}, got {_shown(st.get('version'))}", name
        )
    writing = st.get("writing")
    if not isinstance(writing, (bool, np.bool_)):
        raise _fail(f"{path}['writing']", f"must be True or False, got {_shown(writing)}", name)
    epoch = _int(st, "epoch", path, 0, MAX_EPOCH, name)
    batches = _int(st, "batches", path, 0, MAX_COUNT, name)
    world = _int(st, "world", path, 1, MAX_WORLD, name)
    nw = _int(st, "num_workers", path, 1, MAX_WORKERS, name)
    bs = _int(st, "batch_size", path, 1, MAX_BATCH, name)
    norm: dict[str, Any] = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "batches": batches,
        "world": world,
        "num_workers": nw,
        "batch_size": bs,
        "writing": bool(writing),
    }
    skips = None
    if "skips" in st:
        try:
            skips = Skips.from_json(st["skips"])
        except ValueError as exc:
            raise _fail(f"{path}['skips']", f"is not a list of skipped steps: {exc}", name) from exc
        norm["skips"] = skips.to_json()
    if writing:
        items = st.get("items")
        items = None if items is None else _int_value(items, f"{path}['items']", 0, MAX_COUNT, name)
        for key, mine in (("seed", seed), ("shuffle", shuffle), ("drop_last", drop_last)):
            if key in st and not _same(st[key], mine):
                raise _fail(
                    f"{path}[{key!r}]",
                    f"is {_shown(st[key])}, this loader has {_shown(mine)}: it can't continue "
                    "that epoch",
                    name,
                )
            if key in st:
                norm[key] = mine
        source = st.get("source", "map")
        if source not in ("map", "iterable"):
            raise _fail(
                f"{path}['source']", f"must be 'map' or 'iterable', got {_shown(source)}", name
            )
        if "items" in st:
            norm["items"] = items
        if "source" in st:
            norm["source"] = source
        return LoaderPosition(epoch, batches, world, nw, bs, True, None, items, source, skips, norm)
    if "stream" not in st:
        raise _fail(f"{path}['stream']", "is missing: the state has no streaming position", name)
    if identity is None or epoch_total is None:
        raise _fail(
            f"{path}['stream']",
            "is a streamed epoch's position, but this loader has no written dataset to stream "
            "yet (its first epoch writes it)",
            name,
        )
    pos = check_dataset_state(
        st["stream"],
        identity=identity,
        epoch_total=epoch_total,
        drop_last=drop_last,
        name=name,
        path=f"{path}['stream']",
        worker_state=False,
        extra=extra,
    )
    if pos.progress.epoch != epoch:
        raise _fail(
            f"{path}['epoch']",
            f"is {epoch}, but its streaming position is of epoch {pos.progress.epoch}",
            name,
        )
    norm["stream"] = _normalised(st["stream"], pos, identity, extra)
    return LoaderPosition(epoch, batches, world, nw, bs, False, pos, None, None, skips, norm)


def _normalised(
    raw: Mapping[str, Any],
    pos: DatasetPosition,
    identity: Mapping[str, Any],
    extra: Collection[str],
) -> dict[str, Any]:
    """The dataset state ``pos`` came from, with plain values (its identity, and the
    dataset's own further fields, as given)."""
    pr = pos.progress
    return {
        "version": STATE_VERSION,
        **{k: raw[k] for k in identity if k in raw},
        "epoch": pr.epoch,
        "remaining": None if pr.remaining is None else [list(r) for r in pr.remaining],
        "world": pr.world,
        "num_workers": pr.num_workers,
        "batch_size": pr.batch_size,
        "received": pr.received,
        **{k: copy.deepcopy(raw[k]) for k in extra if k in raw},
    }


# Bounds of a scheduled mix's layout in a state (far above any job).
_MAX_WORLD, _MAX_WORKERS, _MAX_BATCH = 1 << 16, 1 << 10, 1 << 31


def check_mix_layout(raw: Any, name: str) -> tuple[int, int, int, bool]:
    """A scheduled mix's ``layout`` state field, ``[world, workers, batch, drop_last]``,
    checked: ints within bounds and a bool.

    Raises:
        ResumeStateError: anything else (names the mix ``name`` and the value).
    """
    if (
        not isinstance(raw, (list, tuple))
        or len(raw) != 4
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw[:3])
        or not isinstance(raw[3], bool)
        or not 1 <= raw[0] <= _MAX_WORLD
        or not 1 <= raw[1] <= _MAX_WORKERS
        or not 1 <= raw[2] <= _MAX_BATCH
    ):
        raise ResumeStateError(
            f"{name}: the state of a scheduled mix needs its layout "
            f"[world, workers, batch, drop_last], got {raw!r}"
        )
    return int(raw[0]), int(raw[1]), int(raw[2]), bool(raw[3])


def check_worker_slot(pos: DatasetPosition, here: tuple[int, int], name: str) -> None:
    """A single DataLoader worker's state ``pos`` is loaded into the same worker of the
    same worker count (``here``: this worker's id and count).

    Raises:
        ResumeStateError: another worker or worker count (names both).
    """
    if (pos.worker, pos.workers) != here:
        raise ResumeStateError(
            f"{name}: the state is DataLoader worker {pos.worker} of "
            f"{pos.workers}'s position, loaded into worker {here[0]} of {here[1]}; "
            "resume with the same num_workers, or use CacheDataLoader, whose state "
            "resumes with any worker count"
        )
