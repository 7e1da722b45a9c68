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

from .order import Spans
from .partition import Interval, Segment, plan, received_per_worker

__all__ = ["ReaderRuns", "reader_runs", "reader_segments", "window_runs"]

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


def window_runs(
    segments: Sequence[Segment],
    spans: Callable[[int, int], Spans],
    *,
    gap: int = 1,
) -> ReaderRuns:
    """The runs of a reader from the windows of the order, without a key per position.

    ``spans(a, b)`` gives the windows positions ``[a, b)`` touch
    (:meth:`.order.EpochOrder.spans`). Each chunk of a window is taken to be read from
    the window's first position in the stretch to its last: exact without shuffle (a
    window is one chunk), and with shuffle up to the window's stretch longer than
    :func:`reader_runs` (whose runs start at a chunk's first item there and end at its
    last; and a stretch that ends inside a window takes all of its chunks, even one whose
    items there fall outside the stretch). So the plan it gives keeps a little more,
    never less. Cost: arrays of one entry per chunk of each window a segment touches.
    """
    chunk_parts: list[np.ndarray] = []
    start_parts: list[np.ndarray] = []
    end_parts: list[np.ndarray] = []
    t = 0
    for seg in segments:
        got = spans(seg.start, seg.end)
        chunk_parts.append(np.asarray(got.chunks, dtype=np.int64))
        start_parts.append(np.repeat(got.lo + (t - seg.start), got.counts))
        end_parts.append(np.repeat(got.hi + (t - seg.start), got.counts))
        t += len(seg)
    c = np.concatenate(chunk_parts) if chunk_parts else np.empty(0, dtype=np.int64)
    if not len(c):
        empty = np.empty(0, dtype=np.int64)
        return ReaderRuns(empty, empty, empty, t)
    s = np.concatenate(start_parts).astype(np.int64)
    e = np.concatenate(end_parts).astype(np.int64)
    order = np.lexsort((s, c))
    c, s, e = c[order], s[order], e[order]
    # One run per chunk while the next stretch starts within ``gap`` of the last read
    # (position end - 1) of the run so far. The running maximum of the ends within each
    # chunk (shifted by chunk, so one accumulate serves every chunk) is where the run so
    # far ends: earlier runs of the chunk end before it.
    n = len(c)
    big = int(e.max()) + 1
    run_end = np.maximum.accumulate(e + c * big) - c * big
    new = np.ones(n, dtype=bool)
    new[1:] = (c[1:] != c[:-1]) | (s[1:] - (run_end[:-1] - 1) > max(1, gap))
    first = np.flatnonzero(new)
    last = np.append(first[1:], n) - 1
    starts, ends, chunks_out = s[first], run_end[last], c[first]
    by_start = np.argsort(starts, kind="stable")
    return ReaderRuns(chunks_out[by_start], starts[by_start], ends[by_start], t)
