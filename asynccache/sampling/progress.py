"""Where an epoch stands: the plan it runs and how much of it a consumer received. Pure.

A :class:`Progress` is the whole of a resumable position: the epoch, the positions of its
order still to read (None: all of them), the configuration those were split for and the
samples of its share the consumer already received. :meth:`Progress.adapted` expresses
the same position for another configuration (world size, workers, batch size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .partition import Interval, Plan, Segment, consumed_to_remaining, received_per_worker
from .steps import Layout

__all__ = ["Progress", "WorkerPart", "drop", "worker_part"]


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where an epoch stands: the plan it runs and how much of it was already received.

    ``remaining`` (None: the whole epoch) is split for ``(world, num_workers,
    batch_size)``; each rank's consumer has received the first ``received`` samples of
    its share. Continuing with the same configuration keeps the exact order; with another
    one, what is left is split anew (see :func:`consumed_to_remaining`).
    """

    epoch: int = 0
    remaining: tuple[Interval, ...] | None = None
    world: int = 1
    num_workers: int = 1
    batch_size: int = 1
    received: int = 0

    def base(self, total: int) -> list[Interval]:
        """The intervals of the epoch's order this progress splits."""
        if self.remaining is not None:
            return list(self.remaining)
        return [(0, total)] if total else []

    def adapted(
        self, world: int, num_workers: int, batch_size: int, total: int, drop_last: bool
    ) -> Progress:
        """The same position, expressed for this configuration."""
        if self.received == 0:
            return dataclasses.replace(
                self, world=world, num_workers=num_workers, batch_size=batch_size
            )
        if (world, num_workers, batch_size) == (self.world, self.num_workers, self.batch_size):
            return self
        rest = consumed_to_remaining(
            self.base(total),
            world=self.world,
            num_workers=self.num_workers,
            batch_size=self.batch_size,
            drop_last=drop_last,
            received=self.received,
        )
        return Progress(self.epoch, tuple(rest), world, num_workers, batch_size, 0)

    def left(self, total: int, drop_last: bool) -> bool:
        """Some of the epoch is still to be received (the consumer may have got it all)."""
        return bool(
            consumed_to_remaining(
                self.base(total),
                world=self.world,
                num_workers=self.num_workers,
                batch_size=self.batch_size,
                drop_last=drop_last,
                received=self.received,
            )
        )

    def to_json(self) -> list[object]:
        """A JSON-ready list (the inverse of :meth:`from_json`)."""
        rem = None if self.remaining is None else [list(r) for r in self.remaining]
        return [self.epoch, rem, self.world, self.num_workers, self.batch_size, self.received]

    @classmethod
    def from_json(cls, raw: Sequence[Any]) -> Progress:
        """The progress :meth:`to_json` wrote (trusted: written by this process's parent)."""
        epoch, remaining, world, nw, bs, received = raw
        rem = None if remaining is None else tuple((int(a), int(b)) for a, b in remaining)
        return cls(int(epoch), rem, int(world), int(nw), int(bs), int(received))


def drop(segments: Sequence[Segment], n: int) -> list[Segment]:
    """``segments`` without their first ``n`` positions."""
    out = []
    for seg in segments:
        if n >= len(seg):
            n -= len(seg)
            continue
        out.append(Segment(seg.start + n, seg.end, seg.pad))
        n = 0
    return out


@dataclasses.dataclass(frozen=True)
class WorkerPart:
    """What one DataLoader worker of a rank reads of an epoch.

    ``logical``: the worker of the plan it plays (batch ``k`` of the rank comes from
    logical worker ``k mod W``); ``segments``: the positions it reads, in order;
    ``ahead``: positions at the start of its part that the main process handed out
    before it started (read as its own: skipped, not re-read); ``rank_samples``: the
    rank's samples in this (part of the) epoch.
    """

    logical: int
    segments: list[Segment]
    ahead: int
    rank_samples: int


def worker_part(
    progress: Progress, p: Plan, *, worker: int, head: int = 0, skip: int = 0
) -> WorkerPart:
    """The part of ``progress``'s epoch (split by ``p``) that DataLoader worker ``worker``
    of this rank reads.

    Continuing a plan: batch ``k`` of the rank comes from logical worker ``k mod W``, and
    a DataLoader starts its round robin at worker 0, so worker ``j`` plays logical worker
    ``(batches received + j) mod W``, skipping what the consumer already has of it.
    ``head``: samples the main process handed out itself before the workers started:
    received too, but the epoch's plan is the plain one, whose reader skips them as its
    own (``ahead``). ``skip``: positions of its part a loaded worker state had read.
    """
    nw, bs, received = progress.num_workers, progress.batch_size, progress.received
    logical = ((received + head) // bs + worker) % nw
    seen = received_per_worker(p.rank_samples, nw, bs, received)[logical]
    ahead = received_per_worker(p.rank_samples, nw, bs, received + head)[logical] - seen
    return WorkerPart(logical, drop(p.workers[logical], seen + ahead + skip), ahead, p.rank_samples)


def position_state(pr: Progress, remaining: Any, received: int) -> dict[str, Any]:
    """The fields of a resume state that say where position ``pr`` stands: its epoch, the
    ``remaining`` intervals of it (None: the whole epoch), how the consumer was set up, and
    the samples ``received`` (:mod:`.state` checks them on the way back)."""
    return {
        "epoch": pr.epoch,
        "remaining": None if remaining is None else [list(r) for r in remaining],
        "world": pr.world,
        "num_workers": pr.num_workers,
        "batch_size": pr.batch_size,
        "received": received,
    }


def progress_at(layout: Layout, step: int, total: int) -> Progress:
    """Where an uninterrupted run split by ``layout`` stands after ``step`` batches
    (counted from epoch 0's first) of epochs of ``total`` positions.

    Raises:
        ValueError: a negative step, or an epoch too short to have a step.
    """
    epoch, batch = layout.locate(step, total)
    return Progress(
        epoch=epoch,
        world=layout.world,
        num_workers=layout.workers,
        batch_size=layout.batch,
        received=layout.received(batch, total),
    )
