"""Eviction and prefetch that follow the node's epoch plan. Pure: no I/O, no clock, no locks.

Every process on a node can compute what every reader of the node (each DataLoader
worker of each data-parallel rank read on the node: the readers sharing its cache
directory, see :mod:`asynccache.sampling.nodes`) reads this epoch and the next, in order:
the sampler is deterministic. Readers on other nodes are not in the plan: what they read
takes no room in this node's cache. An :class:`EpochPlan` holds that as *runs* (see
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

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["Deferred", "EpochPlan", "PlanPolicy", "Position", "Stream", "cold_bound", "warm_bound"]

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
        streams: one per reader of the node, rank-major (reader ``i * workers + worker``
            for the node's ``i``-th rank).
        sizes: bytes of each chunk, by chunk number.
    """

    def __init__(self, streams: Sequence[Stream], sizes: Sequence[int]) -> None:
        self.streams = list(streams)
        self.sizes = list(sizes)
        self._size_arr = np.asarray(self.sizes, dtype=np.int64)
        n = len(self.sizes)
        runs = np.zeros(n, dtype=np.int64)
        for st in self.streams:
            runs += np.bincount(st.chunks, minlength=n)[:n]
        self.shared = frozenset(np.flatnonzero(runs > 1).tolist())
        self.shared_mask = runs > 1
        self.peaks = [self._peak(st) for st in self.streams]
        self.min_bytes = sum(self.peaks) + sum(self.sizes[c] for c in self.shared)
        self._first: dict[int, np.ndarray] = {}
        self._opening: dict[int, np.ndarray] = {}

    def _peak(self, s: Stream) -> int:
        """The most bytes of this reader's runs that overlap at one position."""
        if not len(s.chunks):
            return 0
        size = self._size_arr[s.chunks]
        at = np.concatenate([s.starts, s.ends])
        kind = np.concatenate([np.ones(len(size), np.int8), np.zeros(len(size), np.int8)])
        delta = np.concatenate([size, -size])
        order = np.lexsort((kind, at))  # at one position, ends (0) come before starts (1)
        return int(max(0, np.cumsum(delta[order]).max()))

    def opening(self, reader: int) -> np.ndarray:
        """Per chunk, whether ``reader`` holds it when its first run ends: what it reads
        at once as it starts (its first chunk, and the next one a batch straddles; its
        first window, shuffled)."""
        got = self._opening.get(reader)
        if got is None:
            st = self.streams[reader]
            got = np.zeros(len(self.sizes), dtype=bool)
            if len(st.chunks):
                s0 = st.starts.min()
                first_end = st.ends[st.starts == s0].min()
                got[st.chunks[st.starts < first_end]] = True
            self._opening[reader] = got
        return got

    def closing(self) -> np.ndarray:
        """Per chunk, whether some reader still holds it at its last position: what the
        readers hold as the epoch ends."""
        got = np.zeros(len(self.sizes), dtype=bool)
        for st in self.streams:
            if len(st.chunks):
                got[st.chunks[st.ends >= st.length]] = True
        return got

    @property
    def read_bytes(self) -> int:
        """Bytes of the chunks some reader reads this epoch."""
        read = np.zeros(len(self.sizes), dtype=bool)
        for st in self.streams:
            read[st.chunks] = True
        return int(self._size_arr[read].sum())

    @property
    def shared_bytes(self) -> int:
        return int(self._size_arr[self.shared_mask].sum())

    def first_starts(self, reader: int) -> np.ndarray:
        """Per chunk, where ``reader`` first reads it (inf: never)."""
        got = self._first.get(reader)
        if got is None:
            st = self.streams[reader]
            got = np.full(len(self.sizes), np.inf)
            np.minimum.at(got, st.chunks, st.starts.astype(np.float64))
            self._first[reader] = got
        return got


@dataclasses.dataclass
class _Table:
    """Every chunk's standing, by chunk number, from where the readers are now."""

    distance: np.ndarray  # positions to the next use, over this epoch and the next
    current: np.ndarray  # some reader reads it now
    this_epoch: np.ndarray  # some reader reads it again in its current epoch
    held: np.ndarray  # read already in an epoch and read again in it (or now): keep
    shared: np.ndarray  # read in two runs in some reader's epoch
    opening: np.ndarray  # what some reader reads at once when its next epoch starts


class PlanPolicy:
    """The node's plan as the store's eviction and admission policy.

    Args:
        names: the chunk files' local names (:func:`.layout.local_name`), by chunk number.
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
        self._memo: tuple[tuple[Position | None, ...], _Table] | None = None

    def _where(self, got: Sequence[Position | None]) -> list[tuple[EpochPlan, int, int]]:
        """(plan of its epoch, position, epoch) of every reader, from the board's ``got``.

        A slot from an epoch before this process's stands for a reader that has not started
        this epoch yet: it is taken to be at this epoch's start, as it will be when it
        starts (what it reads at that slot's position, where the slot is from the epoch just
        before, is kept too: :meth:`_finishing`). (Ranks move together: a rank's new workers
        write their slots moments after the other rank's. Read as it was, the slot would
        hold the last window of the last epoch as "being read" and rank the chunks this
        epoch reads from positions nobody stands at.) So is a slot from more than one epoch
        ahead (left by an earlier run of the same plan), a slot whose plan is unknown (a
        resumed variant that is not this process's), and a missing or torn one. A reader
        that died mid-epoch keeps its slot's meaning until the epoch ends; every reader
        rewrites its slot when it starts an epoch, so no slot outlives the epoch it names.
        """
        out = []
        for r in range(self.readers):
            at = got[r] if r < len(got) else None
            ok = at is not None and self.epoch <= at[0] <= self.epoch + 1
            p = self.plans(at[0], at[1]) if ok and at is not None else None
            if at is None or p is None or r >= len(p.streams):
                mine = self.plans(self.epoch, self.variant)
                assert mine is not None
                out.append((mine, 0, self.epoch))
            else:
                out.append((p, min(at[2], p.streams[r].length), at[0]))
        return out

    def _table(self) -> _Table:
        """Where every chunk stands, from where the readers stand now (the board). One
        reservation asks several questions (admitted? in what order to evict? what may a
        prefetch push out?) of the same positions: the table of the last positions read is
        kept and reused while the board has not changed."""
        got = tuple(self.positions())
        memo = self._memo
        if memo is not None and memo[0] == got:
            return memo[1]
        table = self._compute(got)
        self._memo = (got, table)
        return table

    def _compute(self, got: Sequence[Position | None]) -> _Table:
        """Where every chunk stands. "This epoch" is the later of this process's epoch and
        the reader's: a reader still finishing the last epoch needs this one's chunks too."""
        n = len(self.sizes)
        distance = np.full(n, np.inf)
        this_epoch = np.zeros(n, dtype=bool)
        shared = np.zeros(n, dtype=bool)
        opening = np.zeros(n, dtype=bool)
        read_in: dict[int, np.ndarray] = {}
        needed_in: dict[int, np.ndarray] = {}
        for r, (p, pos, epoch) in enumerate(self._where(got)):
            st = p.streams[r]
            shared |= p.shared_mask
            open_ = st.ends > pos
            mine = np.full(n, np.inf)
            np.minimum.at(mine, st.chunks[open_], np.maximum(st.starts[open_] - pos, 0))
            again = np.isfinite(mine)
            distance = np.minimum(distance, mine)
            this_epoch |= again
            needed_in.setdefault(epoch, np.zeros(n, dtype=bool))[again] = True
            read_in.setdefault(epoch, np.zeros(n, dtype=bool))[st.chunks[st.starts < pos]] = True
            nxt = self.plans(epoch + 1, 0)
            if nxt is not None and r < len(nxt.streams):
                first = nxt.first_starts(r)
                later = np.where(again, np.inf, st.length - pos + first)
                distance = np.minimum(distance, later)
                opening |= nxt.opening(r)
        current = (distance == 0) | self._finishing(got, n)
        held = current.copy()
        for epoch, read in read_in.items():
            held |= read & needed_in.get(epoch, np.zeros(n, dtype=bool))
        return _Table(distance, current, this_epoch, held, shared, opening & ~this_epoch)

    def _finishing(self, got: Sequence[Position | None], n: int) -> np.ndarray:
        """Per chunk, whether a reader whose slot is from the epoch before this process's
        reads it now, there: it may still be finishing that epoch (a rank whose workers
        end later than this one's), and the chunk it reads, or has just downloaded and not
        yet pinned, is not to be the first to go. Only that; the rest of the slot reads as
        the start of this epoch (see :meth:`_where`)."""
        out = np.zeros(n, dtype=bool)
        for r in range(min(self.readers, len(got))):
            at = got[r]
            if at is None or at[0] != self.epoch - 1:
                continue
            p = self.plans(at[0], at[1])
            if p is None or r >= len(p.streams):
                continue
            st = p.streams[r]
            out[st.chunks[(st.starts <= at[2]) & (st.ends > at[2])]] = True
        return out

    def victims(self, own: Sequence[str], last_used: Mapping[str, float]) -> list[str]:
        """``own`` (this dataset's evictable chunk names) in the order to evict them."""
        t = self._table()
        keyed = []
        for name in own:
            ci = self.index.get(name)
            if ci is None:
                key: tuple[bool, bool, float] = (False, False, -math.inf)
            else:
                # A chunk still to be read this epoch goes after every other: not fetching
                # a chunk twice an epoch comes before starting the next epoch warm; last of
                # all one read already this epoch and read again in it.
                key = (bool(t.held[ci]), bool(t.this_epoch[ci]), -float(t.distance[ci]))
            keyed.append((*key, last_used.get(name, 0.0), name))
        keyed.sort()
        return [name for *_, name in keyed]

    def spare(self, own: Iterable[str]) -> list[str]:
        """Of ``own`` (this dataset's chunk names), those no reader needs again this epoch
        (nor holds): what a prefetch may push out."""
        t = self._table()
        out = []
        for name in own:
            ci = self.index.get(name)
            if ci is None or not (t.held[ci] or t.this_epoch[ci] or t.current[ci] or t.opening[ci]):
                out.append(name)
        return out

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
        ci = self.index.get(name)
        if ci is None:
            return True  # not in the plan: not a prefetch the plan asked for
        t = self._table()
        if t.current[ci] or t.shared[ci]:
            return True
        ahead_mask = t.this_epoch & ~t.current & ~t.shared
        ahead = sum(
            self.sizes[oi]
            for oi in (self.index.get(other) for other in present if other != name)
            if oi is not None and ahead_mask[oi]
        )
        return ahead + size <= budget - self.min_bytes


def cold_bound(plan: EpochPlan, budget: int) -> int:
    """The most bytes a cold epoch read by ``plan`` fetches under ``budget``: each chunk
    once (:attr:`EpochPlan.read_bytes`) at or above the plan's minimum; below it (a budget
    of two chunks per reader or more, see :mod:`asynccache.read.readplan`) a chunk two
    readers read may be fetched twice (once more where the main process, building the
    epoch's first batches, fetched it before them: not counted here)."""
    extra = plan.shared_bytes if budget < plan.min_bytes else 0
    return plan.read_bytes + extra


def warm_bound(this: EpochPlan, following: EpochPlan, budget: int) -> int:
    """The most bytes the epoch read by ``following`` fetches after ``this`` under
    ``budget`` (both read whole, one right after the other): the target ``1.1 x (dataset -
    budget)`` where the epoch boundary leaves room for it, else ``dataset - budget + the
    boundary`` and one chunk.

    The boundary: what the readers hold as ``this`` ends (:meth:`EpochPlan.closing`: each
    reader's last chunk, two where its last batch straddles them; its last window,
    shuffled) and what each holds at once as ``following`` starts
    (:meth:`EpochPlan.opening`). The closing chunks take room the budget cannot give to
    chunks the next epoch reads first, so the next epoch fetches about ``dataset -
    (budget - closing)`` at least; an opening the cache did not keep is fetched before
    its reader has read anything the cache could give up, and may push out a chunk kept
    for later in the epoch. With many chunks per reader the boundary is a few percent of
    the dataset and the target holds; with a dozen large chunks and several readers it
    does not (16 chunks, 2 readers, budget 0.6: the readers' last chunks alone are 0.125
    of the dataset, against a target of 0.44). Below the plan's minimum, a chunk several
    readers read may also be fetched more than once.
    """
    dataset = following.read_bytes
    if budget >= dataset:
        return 0
    sizes = np.asarray(following.sizes, dtype=np.int64)
    edge = this.closing()
    for r in range(len(following.streams)):
        edge |= following.opening(r)
    rest = dataset - budget
    # One chunk more: the readers reach the boundary one after the other, and the last
    # prefetch of one may still be in the cache when another opens its next epoch.
    bound = max(int(1.1 * rest), rest + int(sizes[edge].sum()) + int(sizes.max()))
    if budget < max(this.min_bytes, following.min_bytes):
        bound += following.shared_bytes
    return min(bound, dataset + following.shared_bytes)
