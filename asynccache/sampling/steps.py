"""Steps: the batches a consumer receives, counted across epochs. Pure: no I/O, no torch.

A *step* is one batch delivered to the consumer of one data-parallel rank (every rank
takes the same steps). With a fixed :class:`Layout` (data-parallel size, positions per
batch, how the rank split and the consumer treat a remainder) every epoch of ``total``
positions holds the same number of steps ``B``, so step ``S`` of a run is batch
``S mod B`` of epoch ``S div B``: the consumer of each rank has then received the first
``(S mod B) * batch`` positions of its share of that epoch's plain plan
(:mod:`.partition`). That position is a few integers, so a state for step ``S`` costs the
same for ``S = 10`` as for ``S = 10**9``: nothing before it is read or replayed
(:meth:`Layout.locate`).

:class:`Skips` are ranges of steps a run never delivers (the batches around a loss spike):
the consumer that reaches the start of one continues at its end. The skipped samples are
dropped for their epoch, not read later. Steps keep their numbers: after skipping
``[100, 120)`` the batch delivered after step 99 is step 120's.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["MAX_SKIPS", "MAX_STEP", "Layout", "Skips"]

#: Bounds on what a state may say about steps (far above any real run).
MAX_STEP = 1 << 62
MAX_SKIPS = 1 << 14


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an epoch's positions become one rank's steps.

    Args:
        world: data-parallel ranks the epoch is split over.
        batch: positions per step (per batch of one rank's consumer).
        drop_last: the rank split drops the positions that don't divide over the ranks
            (else it pads them, see :func:`~.partition.rank_block`).
        drop_short: the consumer drops a rank's short last batch.
        workers: DataLoader workers a rank's positions are split over (the number of
            steps does not depend on it; which positions a step holds does: each worker
            reads a contiguous run of the rank's share, :func:`~.partition.plan`).
    """

    world: int
    batch: int
    drop_last: bool = False
    drop_short: bool = False
    workers: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or self.batch < 1 or self.workers < 1:
            raise ValueError(
                f"bad layout: world={self.world} batch={self.batch} workers={self.workers}"
            )

    def rank_samples(self, total: int) -> int:
        """Positions each rank reads of a fresh epoch of ``total``."""
        return total // self.world if self.drop_last else -(-total // self.world)

    def batches(self, positions: int) -> int:
        """Steps that ``positions`` positions of one rank make."""
        if positions <= 0:
            return 0
        return positions // self.batch if self.drop_short else -(-positions // self.batch)

    def steps(self, total: int) -> int:
        """Steps of one epoch of ``total`` positions (the same on every rank)."""
        return self.batches(self.rank_samples(total))

    def locate(self, step: int, total: int) -> tuple[int, int]:
        """``(epoch, batch)`` of global step ``step``.

        Raises:
            ValueError: a negative step, or an epoch of no steps.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        per = self.steps(total)
        if per <= 0:
            raise ValueError(f"an epoch of {total} positions has no steps for {self}")
        return divmod(step, per)

    def received(self, batch: int, total: int) -> int:
        """Positions of its share a rank's consumer received before batch ``batch``."""
        return min(batch * self.batch, self.rank_samples(total))

    def batch_at(self, left: int, total: int) -> int:
        """The batch (within its epoch) a consumer stands at when ``left`` positions of its
        share are still to come: the epoch's steps less those ``left`` makes. For a
        resumed part split anew (another world or batch size), the steps are counted
        back from the end of the epoch."""
        return max(0, self.steps(total) - self.batches(left))


class Skips:
    """Ranges ``[start, end)`` of steps never delivered; sorted, disjoint, merged.

    Invariant: :meth:`landing` of any step is a step outside every range, and the first
    such step at or after it.
    """

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for a, b in sorted((int(a), int(b)) for a, b in ranges):
            if not 0 <= a < b <= MAX_STEP:
                raise ValueError(f"a skipped range [{a}, {b}) must have 0 <= start < end")
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        if len(merged) > MAX_SKIPS:
            raise ValueError(f"more than {MAX_SKIPS} skipped ranges")
        self.ranges: tuple[tuple[int, int], ...] = tuple((a, b) for a, b in merged)
        self._starts = [a for a, _ in self.ranges]

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Skips) and other.ranges == self.ranges

    def __hash__(self) -> int:
        return hash(self.ranges)

    def __repr__(self) -> str:
        return f"Skips({list(self.ranges)})"

    def add(self, start: int, end: int) -> Skips:
        """These ranges and ``[start, end)``."""
        return Skips([*self.ranges, (start, end)])

    def union(self, other: Skips) -> Skips:
        return Skips([*self.ranges, *other.ranges])

    def landing(self, step: int) -> int:
        """The first step at or after ``step`` that is not skipped."""
        i = bisect.bisect_right(self._starts, step) - 1
        if i >= 0 and self.ranges[i][1] > step:
            return self.ranges[i][1]  # (merged: the end of one range starts no other)
        return step

    def next_start(self, step: int) -> int | None:
        """The first skipped range's start after ``step`` (None: none)."""
        i = bisect.bisect_right(self._starts, step)
        return self._starts[i] if i < len(self._starts) else None

    def count(self, lo: int, hi: int) -> int:
        """Skipped steps in ``[lo, hi)``."""
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in self.ranges)

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    @classmethod
    def from_json(cls, raw: Any) -> Skips:
        """Ranges as :meth:`to_json` wrote them.

        Raises:
            ValueError: not a list of ``[start, end)`` pairs of ints with
                ``0 <= start < end <= MAX_STEP``, or more than :data:`MAX_SKIPS` of them.
        """
        if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
            raise ValueError(f"skipped ranges must be a list of [start, end), got {raw!r}")
        if len(raw) > MAX_SKIPS:
            raise ValueError(f"more than {MAX_SKIPS} skipped ranges")
        pairs = []
        for r in raw:
            if (
                not isinstance(r, Sequence)
                or isinstance(r, (str, bytes))
                or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            ):
                raise ValueError(f"a skipped range must be [start, end) of ints, got {r!r}")
            pairs.append((r[0], r[1]))
        return cls(pairs)
