"""Who reads which part of an epoch, and what is left of it after a stop.

Positions refer to the epoch order S (see :mod:`.order`). What remains to be read of an
epoch is a short list of ``[start, end)`` intervals of S; a fresh epoch is ``[(0, N)]``.
Concatenated, the remaining intervals form the sequence R that this plan splits.

Split (for ``world`` ranks, ``W`` DataLoader workers per rank, batch size ``B``):

* R is cut into ``world`` contiguous rank blocks of equal length ``n`` — with
  ``drop_last`` the tail ``len(R) mod world`` is dropped; otherwise the blocks are padded
  by repeating R's first samples, as ``DistributedSampler`` does — so every rank takes
  the same number of steps and DDP never waits on a rank that ran out.
* A rank block is cut into batches; batch ``p`` is produced by worker ``p mod W``, which
  is exactly the round-robin order in which a DataLoader collects worker output. Each
  worker's batches are one contiguous run of the block, so a worker reads whole chunks
  (a window of them, when shuffling) rather than a stride through all of them.

A stop is described by how many samples the consumer of each rank received (the same on
every rank under DDP). Since batch ``p`` belongs to worker ``p mod W``, the samples
received are a prefix of every worker's run; :func:`consumed_to_remaining` turns that
into the remaining intervals, which any other world size or worker count can split anew.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

Interval = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Positions ``[start, end)`` of S; ``pad`` marks repeats that only fill a rank up."""

    start: int
    end: int
    pad: bool = False

    def __len__(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Plan:
    """One rank's share: for each worker, the segments it reads in order."""

    workers: tuple[tuple[Segment, ...], ...]
    rank_samples: int
    batch_size: int

    def worker_samples(self, w: int) -> int:
        return sum(len(s) for s in self.workers[w])


def _slice(seq: Sequence[Interval], start: int, end: int) -> list[Interval]:
    """Positions ``[start, end)`` of the concatenation of ``seq``, as intervals of S."""
    out: list[Interval] = []
    pos = 0
    for a, b in seq:
        lo, hi = max(start, pos), min(end, pos + (b - a))
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
        if pos >= end:
            break
    return out


def _length(seq: Sequence[Interval]) -> int:
    return sum(b - a for a, b in seq)


def rank_block(
    remaining: Sequence[Interval], world: int, rank: int, *, drop_last: bool
) -> tuple[list[Segment], int]:
    """Rank ``rank``'s block (segments, pads last) and the per-rank sample count."""
    total = _length(remaining)
    n = total // world if drop_last else -(-total // world)
    segs = [Segment(a, b) for a, b in _slice(remaining, rank * n, (rank + 1) * n)]
    short = n - sum(len(s) for s in segs)
    pos = 0
    while short > 0 and total > 0:  # pad by repeating from the start of R (cycling)
        take = min(short, total - pos)
        segs += [Segment(a, b, pad=True) for a, b in _slice(remaining, pos, pos + take)]
        short -= take
        pos = (pos + take) % total
    return segs, n


def _cut(segs: Sequence[Segment], start: int, end: int) -> list[Segment]:
    out: list[Segment] = []
    pos = 0
    for s in segs:
        lo, hi = max(start, pos), min(end, pos + len(s))
        if lo < hi:
            out.append(Segment(s.start + lo - pos, s.start + hi - pos, s.pad))
        pos += len(s)
    return out


def worker_spans(n: int, num_workers: int, batch_size: int) -> list[tuple[int, int]]:
    """Each worker's contiguous span of a rank block of ``n`` positions (batch ``p`` of the
    rank is batch ``p // num_workers`` of worker ``p % num_workers``'s span)."""
    return _worker_spans(n, num_workers, batch_size)


def _worker_spans(n: int, num_workers: int, batch_size: int) -> list[tuple[int, int]]:
    """Each worker's contiguous span of the rank block ``[0, n)``.

    Batch ``p`` of the rank comes from worker ``p mod W``; all batches are full except the
    rank's last one, so the worker producing that batch gets the short span.
    """
    batches = -(-n // batch_size)
    short = batches * batch_size - n
    last = (batches - 1) % num_workers if batches else -1
    spans, pos = [], 0
    for w in range(num_workers):
        size = (batches // num_workers + (w < batches % num_workers)) * batch_size
        size -= short if w == last else 0
        spans.append((pos, pos + size))
        pos += size
    return spans


def plan(
    remaining: Sequence[Interval],
    *,
    world: int,
    rank: int,
    num_workers: int,
    batch_size: int,
    drop_last: bool,
) -> Plan:
    """This rank's plan; see the module docstring."""
    if not (world >= 1 and 0 <= rank < world and num_workers >= 1 and batch_size >= 1):
        raise ValueError(
            f"bad world={world} rank={rank} workers={num_workers} batch_size={batch_size}"
        )
    block, n = rank_block(remaining, world, rank, drop_last=drop_last)
    spans = _worker_spans(n, num_workers, batch_size)
    return Plan(tuple(tuple(_cut(block, a, b)) for a, b in spans), n, batch_size)


def received_per_worker(n: int, num_workers: int, batch_size: int, received: int) -> list[int]:
    """How much of each worker's span a consumer that got ``received`` samples has seen.

    ``received`` counts whole batches (the consumer gets batches), so it is a multiple of
    the batch size, or ``n`` once the short last batch has arrived.
    """
    spans = _worker_spans(n, num_workers, batch_size)
    if received >= n:
        return [b - a for a, b in spans]
    full = received // batch_size
    return [
        min(b - a, (full // num_workers + (w < full % num_workers)) * batch_size)
        for w, (a, b) in enumerate(spans)
    ]


def consumed_to_remaining(
    remaining: Sequence[Interval],
    *,
    world: int,
    num_workers: int,
    batch_size: int,
    drop_last: bool,
    received: int,
) -> list[Interval]:
    """What is left of the epoch after every rank's consumer received ``received`` samples.

    ``remaining`` and the other arguments describe the plan that was running. Padding
    repeats and (with ``drop_last``) the dropped tail are never "left".
    """
    left: list[Interval] = []
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
        for segs, g in zip(p.workers, got, strict=True):
            total = sum(len(s) for s in segs)
            left += [(s.start, s.end) for s in _cut(segs, g, total) if not s.pad]
    return _merge(left)


def _merge(intervals: list[Interval]) -> list[Interval]:
    """Sort by position in S and join touching intervals (order of S is preserved)."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif a < b:
            out.append((a, b))
    return out
