"""A ``CacheDataLoader``'s state: the fields it saves and the checks a loaded one passes.

A state is one flat dict of constant size: ``version``, ``epoch``, ``batches`` (batches
of that epoch the consumer received, counted per data-parallel rank), ``world``,
``num_workers``, ``batch_size``, ``writing``, and ``skips`` only where steps are skipped
(a state without skips keeps its keys). A streamed epoch's state adds ``stream`` (the
dataset's own state); a writing epoch's adds ``items``, ``seed``, ``shuffle``,
``drop_last`` and ``source``.

Invariants:

* Skipped steps are batches of one (world size, batch size): a state's skips join a
  loader's only where both count in the same batches.
* A writing epoch resumes before its cache is merged only with the same world size,
  workers and batch size (it re-runs, skipping what was received); after the merge only
  with the same world size and batch size (its rest is read back in the same order), and
  never for an ``IterableDataset`` source, whose order is not kept.
* With ``drop_last``, a rest shorter than a batch counts as received: that batch is
  dropped, never handed out, so the epoch is over.

These functions read nothing but their arguments; the loader passes what it knows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ResumeStateError
from ..sampling.steps import Skips
from .map_order import map_batch_count

__all__ = [
    "STATE_VERSION",
    "base_state",
    "check_map_settings",
    "loaded_skips",
    "map_resume",
    "stream_received",
]

STATE_VERSION = 1


def base_state(
    epoch: int,
    batches: int,
    writing: bool,
    *,
    world: int,
    num_workers: int,
    batch_size: int,
    skips: Skips,
) -> dict[str, Any]:
    """The fields every state has: ``batches`` of ``epoch`` received, and how they count."""
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "batches": batches,
        "world": world,
        "num_workers": num_workers,
        "batch_size": batch_size,
        "writing": writing,
    }
    if skips:  # (absent when none: a state without skips keeps its keys)
        state["skips"] = skips.to_json()
    return state


def stream_received(left: int, batches: int, batch_size: int, drop_last: bool) -> int:
    """Items of an epoch part of ``left`` items received after ``batches`` of its
    batches (a dropped short last batch counts as received: the part is over)."""
    received = min(batches * batch_size, left)
    if drop_last and left - received < batch_size:
        received = left
    return received


def loaded_skips(mine: Skips, state: dict[str, Any], *, world: int, batch_size: int) -> Skips:
    """The skipped ranges ``mine`` and those of ``state``, which must count batches of
    the same ``world`` size and ``batch_size``.

    Raises:
        ResumeStateError: the state's skips are malformed or count other batches.
    """
    raw = state.get("skips")
    if raw is None:
        return mine
    try:
        theirs = Skips.from_json(raw)
    except ValueError as exc:
        raise ResumeStateError(f"the state's skips: {exc}") from exc
    got = (state.get("world"), state.get("batch_size"))
    want = (world, batch_size)
    if theirs and got != want:
        raise ResumeStateError(
            f"the state skips steps {theirs.to_json()} counted in batches of (world "
            f"size, batch size) {got}; this loader has {want}, whose steps are other "
            "batches: resume with the same data-parallel size and batch size"
        )
    return mine.union(theirs)


def check_map_settings(state: dict[str, Any], *, seed: int, shuffle: bool, drop_last: bool) -> None:
    """Check that a writing-epoch ``state`` was saved with a loader's order settings.

    Raises:
        ResumeStateError: naming the setting that differs.
    """
    for key, mine in (("seed", seed), ("shuffle", shuffle), ("drop_last", drop_last)):
        if key in state and state[key] != mine:
            raise ResumeStateError(
                f"the state was saved with {key}={state[key]!r}, this loader has "
                f"{key}={mine!r}; it can't continue that epoch"
            )


def map_resume(
    state: dict[str, Any],
    *,
    drop_last: bool,
    writes: bool,
    iterable: bool,
    world: int,
    num_workers: int,
    batch_size: int,
    items: Callable[[], int | None],
) -> dict[str, Any]:
    """Check a writing-epoch ``state`` (its settings checked by
    :func:`check_map_settings`) against a loader's shape and dataset; where its next
    ``iter()`` goes.

    Args:
        state: a checked loader state with ``writing=True``.
        drop_last, batch_size: the loader's.
        writes: the loader's next epoch writes the cache (it is not merged yet).
        iterable: the loader writes an ``IterableDataset``.
        world, num_workers: the process group's size; the loader's workers (at least 1).
        items: the items of the map-order epoch (None: an ``IterableDataset`` being
            written); asked only once the settings match.

    Returns:
        ``writing``, ``epoch``, ``batches``, ``items`` and ``complete`` (every batch of
        the epoch was received).

    Raises:
        ResumeStateError: the state's shape or dataset differ from the loader's.
    """
    got: tuple[int, ...]
    want: tuple[int, ...]
    if writes:
        got = (state["world"], state["num_workers"], state["batch_size"])
        want = (world, num_workers, batch_size)
        what = "(world size, workers, batch size)"
    else:
        if state.get("source") == "iterable" or iterable:
            raise ResumeStateError(
                "the state is from the writing epoch of an IterableDataset; its order "
                "is not kept once the cache is merged, so it can't be continued"
            )
        got = (state["world"], state["batch_size"])
        want = (world, batch_size)
        what = "(world size, batch size)"
    if got != want:
        raise ResumeStateError(
            f"the writing epoch resumes only with the same {what}: state has {got}, "
            f"this loader {want}"
        )
    n = items()
    if n is not None and state.get("items", n) != n:
        raise ResumeStateError(
            f"the state is from a dataset of {state['items']} items, this one has {n}"
        )
    epoch, batches = int(state["epoch"]), int(state["batches"])
    complete = n is not None and batches >= map_batch_count(n, world, batch_size, drop_last)
    return {
        "writing": True,
        "epoch": epoch,
        "batches": batches,
        "items": n,
        "complete": complete,
    }
