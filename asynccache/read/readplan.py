"""One reader following the node's epoch plan: its place on the board, its pins, its hints.

``StreamingDataset`` hands each epoch's plan to its :class:`~asynccache.read.source.DatasetSource`
(:meth:`~asynccache.read.source.DatasetSource.plan_epoch`). From the deterministic order the
source computes what every reader of the node (every DataLoader worker of every
data-parallel rank read on this node, :mod:`asynccache.sampling.nodes`) reads this epoch
and the next (:mod:`asynccache.sampling.runs`), and:

* gives the chunk store a :class:`~asynccache.cache.plan.PlanPolicy`: plan-aware eviction
  and a node-wide prefetch room;
* checks the budget against the plan's minimum, and raises :class:`ConfigError` below it
  (:class:`DiskFullError` where the cache's file system is smaller than the minimum);
* as this reader starts each chunk, records its position on the board, unpins the chunks
  it is done with (its reader may keep their mappings a while: the bytes are never read
  again through them), and hints the downloader with the chunks it reads next.

Layer: above :mod:`asynccache.download`, :mod:`asynccache.cache` and
:mod:`asynccache.sampling`; used by :mod:`asynccache.read.source`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..cache.board import Board, board_path
from ..cache.layout import local_name
from ..cache.plan import EpochPlan, PlanPolicy, Stream, cold_bound, warm_bound
from ..errors import ConfigError, DiskFullError
from ..format import Index
from ..sampling.nodes import NodeLayout
from ..sampling.order import ItemUnits, OrderSpec, ReadOrder, Units
from ..sampling.partition import Interval, Segment
from ..sampling.runs import ReaderRuns, reader_runs, reader_segments, window_runs

__all__ = [
    "CHUNKS_PER_READER",
    "EpochSpec",
    "Fitted",
    "PlanCache",
    "ReadPlan",
    "ReaderPlace",
    "View",
    "budget_bounds",
    "fit_window",
    "least_bytes",
    "min_budget_message",
    "plan_minimum",
    "union_runs",
    "whole_batches",
]

_KEEP_PLANS = 4
#: Epochs of more positions are planned by windows, not by a key per position.
EXACT_UP_TO = 1 << 20


class View(Protocol):
    """Positions read through another order (a mix of datasets): what each reader's
    segments of that order are in this dataset's own order."""

    @property
    def total(self) -> int:
        """Positions of the outer order in an epoch."""
        ...

    @property
    def way(self) -> str:
        """Names the outer order (part of the board's key)."""
        ...

    def project(self, epoch: int) -> Callable[[list[Segment]], list[Segment]]:
        """Maps a reader's segments of the outer order to segments of this dataset's."""
        ...


@dataclasses.dataclass(frozen=True)
class ReaderPlace:
    """Where one reader stands in the node's epoch: the positions still to read
    (``remaining``, split over ``world`` ranks x ``num_workers`` workers in batches of
    ``batch_size``, of which each rank's consumer received ``received``), and which
    reader of them it is (``rank``, ``worker``: the logical worker it plays). ``nodes``:
    the ranks each node reads, this reader's node among them (None: one node reads
    every rank)."""

    epoch: int
    remaining: tuple[Interval, ...]
    received: int
    world: int
    rank: int
    num_workers: int
    worker: int
    batch_size: int
    drop_last: bool
    nodes: NodeLayout | None = None


class EpochSpec:
    """How the node reads one epoch: where this reader stands (``place``) and the order
    every reader follows (``order``, over ``units``; ``view``: the positions are those
    of a mix of datasets)."""

    def __init__(
        self,
        place: ReaderPlace,
        order: OrderSpec,
        units: Units | None = None,
        view: View | None = None,
    ) -> None:
        self.place, self.order, self.units, self.view = place, order, units, view
        self.epoch, self.received = place.epoch, place.received
        self.remaining = [(int(a), int(b)) for a, b in place.remaining]
        self.world, self.rank = place.world, place.rank
        self.num_workers, self.worker = place.num_workers, place.worker
        self.batch_size, self.drop_last = place.batch_size, place.drop_last
        self.seed, self.shuffle, self.window = order.seed, order.shuffle, order.window
        nodes = place.nodes
        if nodes is not None and any(r >= self.world for g in nodes.groups for r in g):
            nodes = None  # a layout of another world (a state's): planned as one node
        if (
            nodes is not None
            and nodes.ranks == tuple(range(self.world))
            and len(nodes.distinct()) == 1
        ):
            nodes = None  # every node reads every rank: the one-node plan, and its board
        self.nodes = nodes
        #: The ranks read on this node, in the order of their readers' board slots.
        self.ranks: tuple[int, ...] = tuple(range(self.world)) if nodes is None else nodes.ranks

    @property
    def readers(self) -> int:
        """The readers on this node: its ranks x workers."""
        return len(self.ranks) * self.num_workers

    @property
    def me(self) -> int:
        """This reader's slot among the node's (replicas of one rank share it)."""
        return self.ranks.index(self.rank) * self.num_workers + self.worker

    def node_specs(self) -> list[EpochSpec]:
        """This way of reading as each node reads it: one spec per distinct group of
        ranks (just this one on one node)."""
        if self.nodes is None:
            return [self]
        out = []
        for group in self.nodes.distinct():
            nodes = NodeLayout(self.nodes.groups, self.nodes.groups.index(group))
            place = dataclasses.replace(self.place, nodes=nodes, rank=group[0])
            out.append(EpochSpec(place, self.order, self.units, self.view))
        return out

    def key(self, checksum: str) -> str:
        """The board of this way of reading the dataset (any epoch) on this node: two
        nodes' plans share a board only where they read the same ranks (the same plan)."""
        way = (*self.order.identity(), self.world, self.num_workers)
        if self.view is not None:
            way += (self.view.way,)
        if self.nodes is not None:
            way += (("node", *self.ranks),)
        raw = repr((checksum, *way, self.batch_size, self.drop_last))
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    def variant(self, total: int) -> int:
        """0 for an epoch read from its start; else a number naming the resumed rest."""
        if self.received == 0 and self.remaining == ([(0, total)] if total else []):
            return 0
        raw = repr((self.remaining, self.received)).encode()
        return 1 + int(hashlib.sha256(raw).hexdigest()[:12], 16)


class PlanCache:
    """The node's :class:`EpochPlan` of a few ``(epoch, variant)``, computed on demand.

    An epoch of up to :data:`EXACT_UP_TO` positions is planned from the key at each
    position (:func:`~asynccache.sampling.runs.reader_runs`); a longer one from the
    order's windows (:func:`~asynccache.sampling.runs.window_runs`), whose shuffled runs
    span their whole window: a few chunks more are kept, the cost stays flat.
    """

    def __init__(self, index: Index, spec: EpochSpec) -> None:
        self.exact_up_to = EXACT_UP_TO  # positions; tests lower it to plan by windows
        self.index = index
        self.spec = spec
        self._plans: collections.OrderedDict[tuple[int, int], EpochPlan] = collections.OrderedDict()
        self._variant = spec.variant(self.total)

    @property
    def total(self) -> int:
        """Positions of an epoch as the readers count them."""
        if self.spec.view is not None:
            return self.spec.view.total
        return self._order(0).total

    def _order(self, epoch: int) -> ReadOrder:
        units = self.spec.units or ItemUnits(self.index)
        return ReadOrder(units, self.spec.order, epoch)

    def same_way(self, spec: EpochSpec) -> bool:
        return spec.key(self.index.checksum) == self.spec.key(self.index.checksum)

    def follow(self, spec: EpochSpec) -> None:
        """Make ``spec`` (same way of reading, another epoch) the resumed variant known."""
        self.spec = spec
        self._variant = spec.variant(self.total)

    def __call__(self, epoch: int, variant: int) -> EpochPlan | None:
        key = (epoch, variant)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        if variant == 0:
            total = self.total
            remaining, received = ([(0, total)] if total else []), 0
        elif variant == self._variant and epoch == self.spec.epoch:
            remaining, received = self.spec.remaining, self.spec.received
        else:
            return None
        plan = self._build(epoch, remaining, received)
        self._plans[key] = plan
        while len(self._plans) > _KEEP_PLANS:
            self._plans.popitem(last=False)
        return plan

    def _build(self, epoch: int, remaining: Sequence[Interval], received: int) -> EpochPlan:
        s, index = self.spec, self.index
        order = self._order(epoch)
        project = s.view.project(epoch) if s.view is not None else None
        by_windows = self._by_windows(order)
        streams = []
        every = reader_segments(
            remaining,
            world=s.world,
            num_workers=s.num_workers,
            batch_size=s.batch_size,
            drop_last=s.drop_last,
            received=received,
        )
        nw = s.num_workers
        for segs in (every[r * nw + w] for r in s.ranks for w in range(nw)):
            if project is not None:
                segs = project(segs)
            last = getattr(order.units, "last_chunks", None)
            if by_windows:
                runs = window_runs(segs, order.spans, gap=order.gap)
            else:
                runs = reader_runs(segs, order.keys, order.chunks_of, gap=order.gap)
            if last is not None:  # a unit (a token block) may run into the next chunk
                runs = union_runs(runs, reader_runs(segs, order.keys, last, gap=order.gap))
            if s.view is None:
                runs = whole_batches(runs, s.batch_size)
            streams.append(Stream(runs.chunks, runs.starts, runs.ends, runs.length))
        return EpochPlan(streams, index.bytes_per_chunk.tolist())

    def _by_windows(self, order: ReadOrder) -> bool:
        """Plan from the order's windows (:func:`window_runs`), not from a key per position:
        for an epoch of more than :data:`EXACT_UP_TO` positions of items whose chunks the
        windows name (shuffled, subsampled, or a plain order of a sequential index)."""
        if order.total <= self.exact_up_to:
            return False
        if getattr(order.units, "last_chunks", None) is not None:
            return False  # token blocks run into the next chunk: each is located
        spec = order.spec
        sampled = spec.subsample is not None and spec.subsample < 1
        sequential = self.index.columns.runs is None  # keys in chunk order
        return spec.shuffle or sampled or sequential


def whole_batches(runs: ReaderRuns, batch_size: int) -> ReaderRuns:
    """The runs of a reader that reads ``batch_size`` positions at a time: a worker
    assembling whole batches holds every chunk of a batch at once, and may ask for them in
    any order. Each run is widened to the batches it touches (``[k * batch_size,
    ...)`` of the reader's positions), and a chunk's runs that then overlap become one.
    (A reader of single items holds less: this keeps a little more than it needs.)

    Runs that start in the same batch stay in the order their chunks are first read
    (their unwidened starts), not in chunk order: the hint follows this order, and the
    downloader drops from its queue the chunks hinted before the one asked for. Ordered
    by chunk, a shuffled window's first batch (chunks 14, 12, 0, 11 as read) was hinted
    0, 11, 12, 14: 0 and 11 took every connection, the reader waited for 14, and asking
    for it dropped 12 from the queue until the reader asked for it too."""
    n = len(runs.chunks)
    if batch_size <= 1 or n == 0:
        return runs
    bs = batch_size
    starts = runs.starts // bs * bs
    ends = np.minimum(-(-runs.ends // bs) * bs, max(runs.length, 1))
    order = np.lexsort((starts, runs.chunks))
    c, st, en = runs.chunks[order], starts[order], ends[order]
    # Merge overlapping runs of one chunk: the running end within each chunk's group.
    group = np.concatenate([[0], np.cumsum(c[1:] != c[:-1])])
    span = int(en.max()) + 1
    reach = np.maximum.accumulate(en + group * span) - group * span
    new = np.ones(n, dtype=bool)
    new[1:] = (c[1:] != c[:-1]) | (st[1:] > reach[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], n) - 1
    out_c, out_s, out_e = c[first], st[first], reach[last]
    read_from = runs.starts[order][first]  # each merged run's first position, unwidened
    by_start = np.lexsort((read_from, out_s))
    return ReaderRuns(out_c[by_start], out_s[by_start], out_e[by_start], runs.length)


def union_runs(a: ReaderRuns, b: ReaderRuns) -> ReaderRuns:
    """The runs of a reader that needs the chunks of both ``a`` and ``b`` (of the same
    positions): overlapping or touching runs of one chunk become one, ordered by start."""
    chunks = np.concatenate([a.chunks, b.chunks])
    starts = np.concatenate([a.starts, b.starts])
    ends = np.concatenate([a.ends, b.ends])
    if not len(chunks):
        return a
    order = np.lexsort((starts, chunks))
    c, s, e = chunks[order], starts[order], ends[order]
    out_c, out_s, out_e = [int(c[0])], [int(s[0])], [int(e[0])]
    for ci, si, ei in zip(c[1:].tolist(), s[1:].tolist(), e[1:].tolist(), strict=True):
        if ci == out_c[-1] and si <= out_e[-1]:
            out_e[-1] = max(out_e[-1], ei)
        else:
            out_c.append(ci)
            out_s.append(si)
            out_e.append(ei)
    by_start = np.argsort(np.asarray(out_s, dtype=np.int64), kind="stable")
    return ReaderRuns(
        np.asarray(out_c, dtype=np.int64)[by_start],
        np.asarray(out_s, dtype=np.int64)[by_start],
        np.asarray(out_e, dtype=np.int64)[by_start],
        max(a.length, b.length),
    )


class ReadPlan:
    """This reader's place in the node's plan of one epoch.

    Thread-safe only under its owner's mutex (the source holds it around every call).
    """

    def __init__(
        self, index: Index, spec: EpochSpec, plans: PlanCache, root: str, skipped: int = 0
    ) -> None:
        self.index = index
        self.spec = spec
        self.me = spec.me
        self.variant = spec.variant(plans.total)
        self.board = Board(board_path(root, spec.key(index.checksum)), spec.readers)
        self.policy = PlanPolicy(
            [local_name(index.filename(c)) for c in range(index.num_chunks)],
            plans,
            epoch=spec.epoch,
            variant=self.variant,
            readers=spec.readers,
            positions=self.board.read,
        )
        mine = plans(spec.epoch, self.variant)
        assert mine is not None
        stream = mine.streams[self.me]
        self._starts = stream.starts.tolist()
        self._ends = stream.ends.tolist()
        self._chunks = stream.chunks.tolist()
        self._runs: dict[int, list[int]] = {}  # chunk -> its run numbers, in order
        for i, c in enumerate(self._chunks):
            self._runs.setdefault(c, []).append(i)
        self.pos = skipped
        self._next = 0  # the first run that starts at or after the position
        # A reader may ask for the chunks of one batch in any order (a batch assembled
        # chunk by chunk): the position may pass a run of the same batch before the reader
        # starts it. Such a run stays *pending*, and holds the board's position at its
        # start, until the reader starts it or the position is a batch past its end.
        self._lookback = max(1, spec.batch_size)
        self._pending: dict[int, None] = {}  # run numbers, in order of start
        self._started: set[int] = set()  # run numbers
        self._at: int | None = None  # the run it moved on to last
        self._seen = 0  # runs before this one were looked at by _pass
        self._board_pos = self.pos
        self.board.write(self.me, spec.epoch, self.variant, self.pos)

    def start(self, ci: int) -> bool:
        """This reader starts (or goes on) reading chunk ``ci``; True when it moved on to a
        new run, so the board, the pins and the hint change."""
        self._expire()
        runs = self._runs.get(ci, ())
        for i in runs:
            if i in self._pending:
                del self._pending[i]  # a run of the batch the position passed
                self._started.add(i)
                self._publish()
                return False
        for i in runs:
            if self._ends[i] > self.pos:
                self._started.add(i)
                if self._starts[i] <= self.pos:
                    return False  # asked again within its run
                self._pass(self._starts[i])
                self.pos = self._starts[i]
                self._at = i
                self._expire()
                self._publish()
                return True
        return False  # not in this reader's plan: random access

    def _pass(self, new: int) -> None:
        """The position moves on to ``new``: the runs not started yet that start before it
        (not looked at before) and end within a batch of it are pending (see :meth:`start`)."""
        hi = bisect.bisect_left(self._starts, new)
        for i in range(self._seen, hi):
            if i not in self._started and self._ends[i] > new - self._lookback:
                self._pending[i] = None
        self._seen = max(self._seen, hi)

    def _expire(self) -> None:
        """Drop the pending runs that ended more than a batch before the position: never
        started, so never read through the cache (items read by range, say)."""
        for i in [i for i in self._pending if self._ends[i] <= self.pos - self._lookback]:
            del self._pending[i]

    def _publish(self) -> None:
        """Write the board's position: this reader's, held back to the start of the
        earliest pending run."""
        at = min([self.pos] + [self._starts[i] for i in self._pending])
        if at != self._board_pos:
            self._board_pos = at
            self.board.write(self.me, self.spec.epoch, self.variant, at)

    def reads_now(self, ci: int) -> bool:
        """Chunk ``ci`` has a run around this reader's position, or a pending one."""
        return any(
            i in self._pending or self._starts[i] <= self.pos < self._ends[i]
            for i in self._runs.get(ci, ())
        )

    def reads_now_name(self, name: str) -> bool:
        ci = self.index.chunk_number(name)
        return ci is not None and self.reads_now(ci)

    def upcoming(self, count: int) -> list[int]:
        """The next ``count`` distinct chunks this reader starts, from its position on:
        the chunk it moved on to last, the chunks of pending runs, then the chunks it
        starts from its position (those it started before are not repeated)."""
        while self._next < len(self._chunks) and self._starts[self._next] < self.pos:
            self._next += 1  # runs are ordered by start and the position only grows
        # The chunk it started last comes first: it is asked for right after this hint,
        # and a hint whose first chunks leave it out would cancel its prefetch.
        first = [self._chunks[self._at]] if self._at is not None else []
        if self._at is None:
            # Before its first chunk, the position inside runs (its first positions handed
            # out before it started, or a resumed reader): those chunks are read first,
            # so they are hinted first, not fetched behind the prefetches of later ones.
            first = [self._chunks[i] for i in range(self._next) if self._ends[i] > self.pos]
        out = dict.fromkeys(first + [self._chunks[i] for i in self._pending])
        i = self._next
        while i < len(self._chunks) and len(out) < count:
            out[self._chunks[i]] = None
            i += 1
        return list(out)

    def close(self) -> None:
        self.board.close()


#: The fewest chunks per reader a cache budget must hold: the chunk a reader reads and the
#: next one, which a batch or a token block straddles.
CHUNKS_PER_READER = 2


def least_bytes(index: Index, readers: int) -> int:
    """The smallest budget a plan of ``readers`` readers runs under:
    :data:`CHUNKS_PER_READER` of the dataset's largest chunk per reader."""
    sizes = index.bytes_per_chunk
    largest = int(sizes.max()) if len(sizes) else 0
    return CHUNKS_PER_READER * largest * max(1, readers)


def _ranks_here(spec: EpochSpec) -> str:
    if spec.nodes is None:
        return f"{spec.world} ranks"
    return f"{len(spec.ranks)} of {spec.world} ranks, read on this node,"


def min_budget_message(url: str, budget: int, least: int, spec: EpochSpec) -> str:
    mib = 1 << 20
    return (
        f"{url}: the cache budget (ASYNCCACHE_MAX_CACHE_BYTES / max_cache_bytes, or less "
        f"where the file system holds less: {budget} bytes, {budget / mib:.1f} MiB) is "
        f"below the minimum of {least} bytes ({least / mib:.1f} MiB) for {spec.readers} "
        f"readers ({_ranks_here(spec)} x {spec.num_workers} workers) sharing this node's "
        f"cache: {CHUNKS_PER_READER} of the largest chunk per reader (the chunk it reads "
        f"and the next one, which a batch straddles). Raise the budget to at least "
        f"{least}, or read with fewer workers"
    )


def raise_if_below(url: str, budget: int, index: Index, spec: EpochSpec) -> None:
    """Refuse a budget below :func:`least_bytes` (above it a plan runs: below the plan's
    own minimum, see :func:`fit_window`, with a smaller shuffle window or, at window 1,
    fetching a chunk several readers share more than once an epoch)."""
    least = least_bytes(index, spec.readers)
    if budget < least:
        raise ConfigError(min_budget_message(url, budget, least, spec))


def plan_minimum(index: Index, spec: EpochSpec, window: int) -> int:
    """:attr:`EpochPlan.min_bytes` of ``spec``'s epoch and the next, read whole with
    shuffle window ``window``: the larger (the eviction policy of an epoch looks at both,
    and a shuffle's minimum moves a little from one epoch to the next)."""
    order = dataclasses.replace(spec.order, window=window)
    total = PlanCache(index, EpochSpec(spec.place, order, spec.units, spec.view)).total
    place = dataclasses.replace(spec.place, remaining=((0, total),) if total else (), received=0)
    plans = PlanCache(index, EpochSpec(place, order, spec.units, spec.view))
    got = [plans(spec.epoch, 0), plans(spec.epoch + 1, 0)]
    return max(p.min_bytes for p in got if p is not None)


def budget_bounds(index: Index, spec: EpochSpec, budget: int) -> tuple[int, int]:
    """The most bytes ``spec``'s epoch fetches cold under ``budget``, and the most the
    epoch after it fetches again (:func:`~asynccache.cache.plan.cold_bound`,
    :func:`~asynccache.cache.plan.warm_bound`), both read whole by the readers of
    ``spec.place`` in ``spec.order`` (the window read with)."""
    total = PlanCache(index, spec).total
    place = dataclasses.replace(spec.place, remaining=((0, total),) if total else (), received=0)
    plans = PlanCache(index, EpochSpec(place, spec.order, spec.units, spec.view))
    this, following = plans(spec.epoch, 0), plans(spec.epoch + 1, 0)
    assert this is not None and following is not None
    return cold_bound(this, budget), warm_bound(this, following, budget)


@dataclasses.dataclass(frozen=True)
class Fitted:
    """The shuffle window an epoch is read with under a budget, and why."""

    window: int
    requested: int
    budget: int
    needs: int  # the plan's minimum at ``window``
    needed: int  # the plan's minimum at ``requested``

    @property
    def shrunk(self) -> bool:
        return self.window < self.requested

    def why(self, readers: int) -> str:
        mib = 1 << 20
        if not self.shrunk:
            return f"shuffle_window {self.window}: its plan needs {self.needs} bytes"
        below = (
            "; even window 1 needs more, so a chunk several readers share may be fetched more "
            "than once an epoch"
            if self.needs > self.budget
            else ""
        )
        return (
            f"shuffle_window {self.requested} needs {self.needed / mib:.1f} MiB of cache for "
            f"{readers} readers, more than the budget of {self.budget / mib:.1f} MiB: "
            f"reading with shuffle_window {self.window} (needs {self.needs / mib:.1f} MiB)"
            f"{below}"
        )


def fit_window(url: str, index: Index, spec: EpochSpec, budget: int) -> Fitted:
    """The largest shuffle window, at most ``spec.window``, whose plan's minimum (what the
    readers hold at once, see :class:`~asynccache.cache.plan.EpochPlan`) fits ``budget``
    on every node (each node's plan counts its own readers); window 1 when none does. A
    pure function of (the requested window, the budget, the node layout, the readers, the
    chunks and the order), so every reader that asks gets the same answer: on every node
    where the budget is the same.

    Raises:
        ConfigError: ``budget`` is below :func:`least_bytes`.
    """
    raise_if_below(url, budget, index, spec)
    want = spec.window
    if not spec.shuffle or want <= 1:
        return Fitted(want, want, budget, 0, 0)
    # Every node reads one order: the window is fitted to the node whose plan needs most
    # (each node works this out for all, so all choose the same window).
    specs = spec.node_specs()

    def minimum(window: int) -> int:
        return max(plan_minimum(index, s, window) for s in specs)

    needed = minimum(want)
    if needed <= budget:
        return Fitted(want, want, budget, needed, needed)
    # Not monotone in the window (a window of 3 can split a reader's part where 4 does
    # not, and share more chunks): the largest that fits, looked at one by one.
    needs = needed
    for window in range(want - 1, 0, -1):
        needs = minimum(window)
        if needs <= budget:
            return Fitted(window, want, budget, needs, needed)
    return Fitted(1, want, budget, needs, needed)


def raise_if_disk_below(
    url: str, cache_dir: str, capacity: int, index: Index, spec: EpochSpec
) -> None:
    """Refuse, before the epoch starts, a plan whose readers cannot hold what they read at
    once on the cache's file system even with nothing else on it (``capacity``: its size
    less the margin kept free): they would stop mid-epoch, each waiting for room the
    others hold."""
    least = least_bytes(index, spec.readers)
    if capacity < least:
        mib = 1 << 20
        raise DiskFullError(
            f"{url}: the file system of the cache dir {cache_dir} holds {capacity} bytes "
            f"({capacity / mib:.1f} MiB), less than the {least} bytes "
            f"({least / mib:.1f} MiB) that {spec.readers} readers ({_ranks_here(spec)} "
            f"x {spec.num_workers} workers) sharing this node's cache read at once "
            f"({CHUNKS_PER_READER} of the largest chunk per reader). Give the cache a "
            f"larger file system (ASYNCCACHE_CACHE_DIR), or read with fewer workers"
        )
