"""Which chunks every reader of an epoch reads, and when. Pure: no I/O, no torch.

A *reader* is one DataLoader worker of one rank; reader ``rank * num_workers + w`` reads
the segments of logical worker ``w`` in ``rank``'s :func:`.partition.plan`, less what its
consumer already received. Its *positions* count what it reads, from 0.

A *run* of a chunk is a stretch ``[start, end)`` of one reader's positions from the first
to the last item it takes from that chunk there. Without shuffle a run is contiguous;
with shuffle the items of a window's chunks interleave, so the runs of one window
overlap. Two stretches of the same chunk further apart than ``gap`` positions (a padding
repeat, a chunk split over two windows' neighbours) are two runs. A reader needs a chunk
from the start of a run to its end, and not in between two runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from .partition import Interval, Segment, plan, received_per_worker

__all__ = ["ReaderRuns", "reader_runs", "reader_segments"]

_BLOCK = 65536  # positions materialised at a time


@dataclasses.dataclass(frozen=True)
class ReaderRuns:
    """One reader's epoch: its runs, ordered by start, and how many positions it reads."""

    chunks: np.ndarray  # chunk number of each run
    starts: np.ndarray
    ends: np.ndarray  # exclusive
    length: int


def reader_segments(
    remaining: Sequence[Interval],
    *,
    world: int,
    num_workers: int,
    batch_size: int,
    drop_last: bool,
    received: int = 0,
) -> list[list[Segment]]:
    """Every reader's segments, rank-major, without what its consumer already received."""
    out: list[list[Segment]] = []
    for rank in range(world):
        p = plan(
            remaining,
            world=world,
            rank=rank,
            num_workers=num_workers,
            batch_size=batch_size,
            drop_last=drop_last,
        )
        got = received_per_worker(p.rank_samples, num_workers, batch_size, received)
        for w in range(num_workers):
            out.append(_skip(p.workers[w], got[w]))
    return out


def _skip(segments: Sequence[Segment], n: int) -> list[Segment]:
    out = []
    for seg in segments:
        if n >= len(seg):
            n -= len(seg)
            continue
        out.append(Segment(seg.start + n, seg.end, seg.pad))
        n = 0
    return out


def reader_runs(
    segments: Sequence[Segment],
    keys: Callable[[int, int], np.ndarray],
    locate: Callable[[np.ndarray], np.ndarray],
    *,
    gap: int = 1,
) -> ReaderRuns:
    """The runs of a reader that reads ``segments`` of the epoch order.

    Args:
        segments: what the reader reads, in order (see :func:`reader_segments`).
        keys: the keys at positions ``[a, b)`` of the epoch order.
        locate: the chunk number of each key.
        gap: occurrences of a chunk at most this many positions apart are one run.
    """
    parts = []
    for seg in segments:
        for a in range(seg.start, seg.end, _BLOCK):
            parts.append(np.asarray(locate(keys(a, min(seg.end, a + _BLOCK))), dtype=np.int64))
    chunks = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    n = len(chunks)
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return ReaderRuns(empty, empty, empty, 0)
    pos = np.arange(n, dtype=np.int64)
    order = np.lexsort((pos, chunks))
    c, t = chunks[order], pos[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (c[1:] != c[:-1]) | (t[1:] - t[:-1] > max(1, gap))
    first = np.flatnonzero(new)
    last = np.append(first[1:], n) - 1
    starts, ends, run_chunks = t[first], t[last] + 1, c[first]
    by_start = np.argsort(starts, kind="stable")
    return ReaderRuns(run_chunks[by_start], starts[by_start], ends[by_start], n)
