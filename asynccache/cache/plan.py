"""Eviction and prefetch that follow the node's epoch plan. Pure: no I/O, no clock, no locks.

Every process on a node can compute what every reader of the node (each DataLoader
worker of each rank) reads this epoch and the next, in order: the sampler is
deterministic. An :class:`EpochPlan` holds that as *runs* (see
:mod:`asynccache.sampling.runs`): chunk ``c`` is read by reader ``r`` over positions
``[start, end)`` of ``r``'s part of the epoch. With where each reader stands (its epoch
and position, from the :mod:`.board`), :class:`PlanPolicy` answers the two questions
the store asks under its eviction lock:

* **Which chunks go first** (:meth:`PlanPolicy.victims`): Belady's order over two
  epochs. A chunk's *next use* is the fewest positions any reader has to go before it
  reads the chunk again, this epoch or the next (a use next epoch is counted after the
  rest of that reader's epoch). First go the chunks no reader needs again this epoch,
  the one used furthest away first (never used again, then the ones the next epoch reads
  last); only then chunks still to be read this epoch, again furthest first. Ties go
  least recently used first.
* **May a prefetch take room now** (:meth:`PlanPolicy.admits`): the cache must always
  be able to hold what the readers need at once without evicting a chunk still to be
  read. That is :attr:`EpochPlan.min_bytes`: for each reader, the most bytes of runs that
  overlap (what it has pinned plus the chunk it is fetching), plus every chunk read in
  two runs (two readers, or a padding repeat), which must stay between them. What is
  left of the budget is the node's prefetch room: chunks fetched ahead of their run and
  not read yet may fill it, no more. So a prefetch never forces out a chunk that is
  still to be read.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["Deferred", "EpochPlan", "PlanPolicy", "Position", "Stream"]

Position = tuple[int, int, int]  # (epoch, variant, position) of one reader


class Deferred(Exception):
    """A prefetch would not fit the node's prefetch room now; try again later."""


@dataclasses.dataclass(frozen=True)
class Stream:
    """One reader's epoch: its runs ordered by start, and how many positions it reads."""

    chunks: np.ndarray
    starts: np.ndarray
    ends: np.ndarray  # exclusive
    length: int


class EpochPlan:
    """What every reader of the node reads in one epoch.

    Args:
        streams: one per reader, rank-major (reader ``rank * workers + worker``).
        sizes: bytes of each chunk, by chunk number.
    """

    def __init__(self, streams: Sequence[Stream], sizes: Sequence[int]) -> None:
        self.streams = list(streams)
        self.sizes = list(sizes)
        # chunk -> reader -> (starts, ends) of its runs, ordered
        self._uses: dict[int, dict[int, tuple[list[int], list[int]]]] = {}
        runs_of: dict[int, int] = {}
        for r, s in enumerate(self.streams):
            for c, a, b in zip(s.chunks.tolist(), s.starts.tolist(), s.ends.tolist(), strict=True):
                starts, ends = self._uses.setdefault(c, {}).setdefault(r, ([], []))
                starts.append(a)
                ends.append(b)
                runs_of[c] = runs_of.get(c, 0) + 1
        self.shared = frozenset(c for c, n in runs_of.items() if n > 1)
        self.peaks = [self._peak(s) for s in self.streams]
        self.min_bytes = sum(self.peaks) + sum(self.sizes[c] for c in self.shared)

    def _peak(self, s: Stream) -> int:
        """The most bytes of this reader's runs that overlap at one position."""
        runs = list(zip(s.chunks.tolist(), s.starts.tolist(), s.ends.tolist(), strict=True))
        events = sorted(
            [(a, 1, self.sizes[c]) for c, a, _ in runs]
            + [(b, 0, -self.sizes[c]) for c, _, b in runs]
        )
        held = peak = 0
        for _, _, delta in events:  # at one position, ends (0) come before starts (1)
            held += delta
            peak = max(peak, held)
        return peak

    def next_use(self, chunk: int, reader: int, pos: int) -> int | None:
        """Positions until ``reader`` at ``pos`` reads ``chunk`` (0: it reads it now), or
        None when it does not read it again this epoch."""
        runs = self._uses.get(chunk, {}).get(reader)
        if runs is None:
            return None
        starts, ends = runs
        i = bisect.bisect_right(ends, pos)  # the first run that has not ended
        if i == len(ends):
            return None
        return max(0, starts[i] - pos)

    def read_before(self, chunk: int, reader: int, pos: int) -> bool:
        """``reader`` at ``pos`` has started a run of ``chunk`` already."""
        runs = self._uses.get(chunk, {}).get(reader)
        return runs is not None and runs[0][0] < pos

    def first_use(self, chunk: int, reader: int) -> int | None:
        runs = self._uses.get(chunk, {}).get(reader)
        return runs[0][0] if runs else None

    def readers_of(self, chunk: int) -> Iterable[int]:
        return self._uses.get(chunk, {}).keys()


@dataclasses.dataclass
class _Class:
    distance: float  # positions to the next use, over this epoch and the next
    current: bool  # some reader reads it now
    this_epoch: bool  # some reader reads it again in its current epoch
    held: bool = False  # read already in an epoch and read again in it: keep


class PlanPolicy:
    """The node's plan as the store's eviction and admission policy.

    Args:
        names: the chunk file names, by chunk number.
        plans: the plan of ``(epoch, variant)`` (variant 0: the epoch from its start),
            or None when unknown; the caller caches.
        epoch, variant: the epoch this process runs.
        readers: how many readers the node has.
        positions: where each reader stands now (None: not started; taken to be at the
            start of ``epoch``).
    """

    def __init__(
        self,
        names: Sequence[str],
        plans: Callable[[int, int], EpochPlan | None],
        *,
        epoch: int,
        variant: int,
        readers: int,
        positions: Callable[[], Sequence[Position | None]],
    ) -> None:
        self.index = {n: i for i, n in enumerate(names)}
        self.plans = plans
        self.epoch, self.variant = epoch, variant
        self.readers = readers
        self.positions = positions
        here = plans(epoch, variant)
        following = plans(epoch + 1, 0)
        assert here is not None
        self.sizes = here.sizes
        self.dataset_bytes = sum(here.sizes)
        self.min_bytes = max(here.min_bytes, following.min_bytes if following else 0)

    def _where(self) -> list[tuple[EpochPlan, int, int]]:
        """(plan of its epoch, position, epoch) of every reader."""
        out = []
        got = list(self.positions())
        for r in range(self.readers):
            at = got[r] if r < len(got) else None
            p = self.plans(at[0], at[1]) if at is not None else None
            if at is None or p is None or r >= len(p.streams):
                mine = self.plans(self.epoch, self.variant)
                assert mine is not None
                out.append((mine, 0, self.epoch))
            else:
                out.append((p, min(at[2], p.streams[r].length), at[0]))
        return out

    def _classify(self, chunk: int, where: list[tuple[EpochPlan, int, int]]) -> _Class:
        """Its next use; "this epoch" is the later of this process's epoch and the
        reader's: a reader still finishing the last epoch needs this one's chunks too."""
        best, current, now = math.inf, False, False
        read_in: set[int] = set()
        needed_in: set[int] = set()
        for r, (p, pos, epoch) in enumerate(where):
            if p.read_before(chunk, r, pos):
                read_in.add(epoch)
            d = p.next_use(chunk, r, pos)
            if d is not None:
                needed_in.add(epoch)
                now = True
                current = current or d == 0
                best = min(best, d)
                continue
            nxt = self.plans(epoch + 1, 0)
            first = nxt.first_use(chunk, r) if nxt is not None else None
            if first is not None:
                best = min(best, p.streams[r].length - pos + first)
                now = now or epoch < self.epoch
        return _Class(best, current, now, current or bool(read_in & needed_in))

    def victims(self, own: Sequence[str], last_used: Mapping[str, float]) -> list[str]:
        """``own`` (this dataset's evictable chunk names) in the order to evict them."""
        where = self._where()
        keyed = []
        for name in own:
            ci = self.index.get(name)
            k = _Class(math.inf, False, False) if ci is None else self._classify(ci, where)
            # A chunk still to be read this epoch goes after every other: not fetching a
            # chunk twice an epoch comes before starting the next epoch warm; last of all
            # one read already this epoch and read again in it.
            keyed.append((k.held, k.this_epoch, -k.distance, last_used.get(name, 0.0), name))
        keyed.sort()
        return [name for *_, name in keyed]

    def fits_whole(self, budget: int) -> bool:
        """The whole dataset fits in the prefetch room: no prefetch needs asking."""
        return self.dataset_bytes <= budget - self.min_bytes

    def admits(self, name: str, size: int, present: Iterable[str], budget: int) -> bool:
        """May ``name`` (``size`` bytes) be fetched ahead now, with ``present`` (this
        dataset's chunks published or being downloaded) in the cache?

        Chunks fetched ahead and not yet read by anyone (*ahead*) may take at most
        ``budget - min_bytes``. What a reader reads now, and chunks read in two runs, are
        covered by ``min_bytes`` and always admitted.
        """
        where = self._where()
        shared: set[int] = set()
        for p, _, _ in where:
            shared |= p.shared
        ci = self.index.get(name)
        if ci is None:
            return True  # not in the plan: not a prefetch the plan asked for
        mine = self._classify(ci, where)
        if mine.current or ci in shared:
            return True
        ahead = 0
        for other in set(present) - {name}:
            oi = self.index.get(other)
            if oi is None or oi in shared:
                continue
            k = self._classify(oi, where)
            if k.this_epoch and not k.current:
                ahead += self.sizes[oi]
        return ahead + size <= budget - self.min_bytes
