"""The order of a mix of datasets: which stream each position of a mixed epoch reads.

A mixed epoch is a sequence of *slots*. In ``random`` mode a slot is one sample; in
``per_stream`` and ``stratified`` modes it is one batch of ``batch_size`` samples. Slot
``q`` of the epoch belongs to stream ``s(q)``, and the ``k``-th sample of stream ``s`` in
the epoch reads position ``k`` of that stream's own (chunk-aware, possibly wrapped) epoch
order. So the samples of one stream that any contiguous range of slots holds are one
contiguous range of that stream's order (:meth:`MixOrder.before` gives its ends): a
reader of a contiguous part of the mix reads each stream in its own chunk-aware order, and
a mix costs no extra downloads. The rank x worker partition, resume and elastic resume
work on slots exactly as on the samples of one dataset (:mod:`.partition`).

How the slots are dealt (all a pure function of the counts, ``seed`` and ``epoch``):

* ``random`` and ``per_stream``: stream ``s`` has ``N_s`` slots of ``M``. The epoch is
  cut into blocks of about ``block`` slots; block ``k`` holds exactly
  ``C_s((k+1)G) - C_s(kG)`` slots of stream ``s``, where ``C_s(m) = ceil(m N_s / M - 1/2)``
  (clamped to ``[0, N_s]``) counts the ticks ``(j + 1/2) M / N_s`` below ``m``. ``C_s`` is
  monotone and ends at ``N_s``, so every stream gets exactly its count, and every prefix of
  the epoch holds each stream's share to within one block's rounding. Within a block the
  slots are shuffled (seeded by ``(seed, epoch, block)``).
* ``stratified``: every batch holds ``c_s`` samples of stream ``s`` (the batch size
  apportioned by the streams' counts, largest remainder), stream 0's first, then
  stream 1's, and so on.

Schedules (:class:`Schedule`, :class:`ScheduledMix`): the weights change with the consumer's
*step* (:mod:`.steps`: one batch of one data-parallel rank, counted across epochs). A step's
slots are where the split puts them (:mod:`.partition`), so the deal follows the
:class:`~.steps.Layout` (DP size ``W``, DataLoader workers ``K``, ``b`` slots a step, the
split's and the consumer's ``drop_last``): with ``M`` slots, ``n`` of them a rank and ``B``
steps an epoch, rank ``r`` reads slots ``[r n, (r+1) n)``, cut into ``K`` contiguous worker
spans; batch ``j`` of worker ``k``'s span (``b`` slots) is the rank's step ``t = j K + k``,
and its slots take the weights of global step ``e B + t`` in epoch ``e``. (Slots of no
delivered step, a short last batch the consumer drops or the tail the split drops, take the
weights of the epoch's last step; they are never read. Padding repeats slots of the epoch's
start, with their own weights.) Within each worker span, the slots of consecutive batches of
equal weights form a *piece*; a piece of ``L`` slots gives stream ``s`` exactly its
largest-remainder share of ``L`` by the weights (``stratified``: of each batch of the piece;
a stream of weight 0 gets none) and is dealt inside as an unscheduled mix of those counts,
seeded by ``(seed, epoch, piece)``. The ``k``-th sample of stream ``s`` over the pieces in
slot order still reads position ``k`` of its own order: a contiguous range of slots is still
a contiguous range of each stream's order. Each rank's batch at step ``S`` holds only
streams the weights of step ``S`` give a share, and each piece holds exactly its share
(within it, proportions drift as in an unscheduled mix: by at most one deal block's
rounding). The epoch's total is the unscheduled one (the weighted streams'
lengths summed, or ``epoch_size``); how much each stream gives an epoch follows from the
weights. An epoch keeps the layout it started with when it is resumed with another world
size, worker count or batch size, so the resumed rest reads exactly what was left; the
steps of that rest then meet the weights of the old layout's steps.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from .partition import worker_spans
from .steps import Layout

__all__ = [
    "MODES",
    "MixOrder",
    "Schedule",
    "ScheduledMix",
    "Share",
    "apportion",
    "check_weights",
    "stream_counts",
]

MODES = ("random", "per_stream", "stratified")
_MIX_STREAM = 0x4D49  # rng stream of the mix (not a dataset's own order)


@dataclasses.dataclass(frozen=True)
class Share:
    """How much of a stream a mixed epoch takes: exactly one of

    * ``weight``: a share of the samples that the weighted streams fill together;
    * ``repeat``: this many passes over the stream (``0.5``: half of it, ``2``: twice);
    * ``choose``: exactly this many samples.
    """

    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        given = [x for x in (self.weight, self.repeat, self.choose) if x is not None]
        if len(given) > 1:
            raise ValueError("give a stream one of weight=, repeat= or choose=, not several")
        if self.weight is not None and not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight must be a positive number, got {self.weight!r}")
        if self.repeat is not None and not (self.repeat >= 0 and math.isfinite(self.repeat)):
            raise ValueError(f"repeat must be a non-negative number, got {self.repeat!r}")
        if self.choose is not None and not (isinstance(self.choose, int) and self.choose >= 0):
            raise ValueError(f"choose must be a non-negative integer, got {self.choose!r}")

    @property
    def weighted(self) -> bool:
        return self.repeat is None and self.choose is None


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder; ties to the first)."""
    w = np.asarray(weights, dtype=np.float64)
    if total <= 0 or len(w) == 0 or w.sum() <= 0:
        return [0] * len(w)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    rest = total - int(out.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - out)))
    out[order[:rest]] += 1
    return [int(x) for x in out]


def stream_counts(
    lengths: Sequence[int], shares: Sequence[Share], epoch_size: int | None = None
) -> list[int]:
    """Samples each stream gives one mixed epoch.

    ``lengths``: each stream's own epoch length. ``repeat`` and ``choose`` streams take
    ``round(repeat * length)`` and ``choose``; the weighted streams share the rest of
    ``epoch_size`` (default: the sum of their own lengths) by weight.
    """
    fixed = [
        (round(sh.repeat * n) if sh.repeat is not None else sh.choose)
        for n, sh in zip(lengths, shares, strict=True)
    ]
    weighted = [i for i, sh in enumerate(shares) if sh.weighted]
    if epoch_size is None:
        room = sum(lengths[i] for i in weighted)
    else:
        room = epoch_size - sum(int(x) for x in fixed if x is not None)
        if room < 0 or (room > 0 and not weighted):
            raise ValueError(
                f"epoch_size={epoch_size} does not match the streams' repeat/choose counts "
                f"({sum(int(x) for x in fixed if x is not None)} samples)"
            )
    split = apportion(room, [shares[i].weight or 1.0 for i in weighted])
    out = [int(x) if x is not None else 0 for x in fixed]
    for i, n in zip(weighted, split, strict=True):
        out[i] = n
    return out


class MixOrder:
    """Slots of one mixed epoch and the stream position each sample reads.

    Args:
        counts: samples of each stream wanted in the epoch (see :func:`stream_counts`).
            ``per_stream`` rounds each down to whole batches; ``stratified`` makes every
            batch hold the same per-stream counts and takes ``sum // batch_size`` batches.
        mode: ``random``, ``per_stream`` or ``stratified``.
        batch_size: samples per batch (the slot of ``per_stream`` and ``stratified``).
        seed, epoch: the deal is a pure function of these and the counts.
        block: slots per block when dealing (``random``, ``per_stream``).
        salt: more words of the deal's seed (a scheduled mix deals each of its pieces
            as a mix of its own, :class:`ScheduledMix`).
    """

    def __init__(
        self,
        counts: Sequence[int],
        *,
        mode: str,
        batch_size: int,
        seed: int,
        epoch: int,
        block: int = 1024,
        salt: Sequence[int] = (),
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mix mode must be one of {', '.join(MODES)}; got {mode!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.mode, self.seed, self.epoch = mode, seed, epoch
        self.streams = len(counts)
        self.unit = 1 if mode == "random" else batch_size  # samples per slot
        self.block = max(1, block)
        self._salt = [int(x) for x in salt]
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None
        if mode == "stratified":
            total = sum(counts)
            self.per_batch = np.asarray(apportion(batch_size, counts), dtype=np.int64)
            self.slots = total // batch_size if total else 0
            self._cum = np.concatenate([[0], np.cumsum(self.per_batch)])
            self.counts = [int(c) * self.slots for c in self.per_batch]
        else:
            self.slot_counts = [int(c) // self.unit for c in counts]
            self.slots = sum(self.slot_counts)
            self.counts = [n * self.unit for n in self.slot_counts]
            self._blocks = -(-self.slots // self.block) if self.slots else 0

    @property
    def total(self) -> int:
        """Samples in the epoch (``slots * unit``)."""
        return self.slots * self.unit

    # -- dealing (random, per_stream) -------------------------------------------------
    def _ticks(self, m: int) -> np.ndarray:
        """``C_s(m)`` for every stream: stream-``s`` slots among the first ``m`` slots'
        worth of ticks (see the module docstring)."""
        m = min(max(m, 0), self.slots)
        big_m = self.slots
        out = np.empty(self.streams, dtype=np.int64)
        for s, n in enumerate(self.slot_counts):
            c = -((big_m - 2 * m * n) // (2 * big_m))  # ceil(m n / M - 1/2)
            out[s] = min(max(c, 0), n)
        return out

    def _block_start(self, k: int) -> int:
        return int(self._ticks(k * self.block).sum())

    def _find_block(self, q: int) -> int:
        k = min(q // self.block, self._blocks - 1)
        while k > 0 and self._block_start(k) > q:
            k -= 1
        while k + 1 < self._blocks and self._block_start(k + 1) <= q:
            k += 1
        return k

    def _deal(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``k``: the stream of each slot and its rank among that stream's slots of
        the epoch."""
        if self._cache is not None and self._cache[0] == k:
            return self._cache[1], self._cache[2]
        lo, hi = self._ticks(k * self.block), self._ticks((k + 1) * self.block)
        seq = np.repeat(np.arange(self.streams, dtype=np.int64), hi - lo)
        rng = np.random.default_rng(
            [self.seed & (2**63 - 1), self.epoch, _MIX_STREAM, k, *self._salt]
        )
        seq = seq[rng.permutation(len(seq))]
        rank = np.empty(len(seq), dtype=np.int64)
        for s in range(self.streams):
            where = np.flatnonzero(seq == s)
            rank[where] = lo[s] + np.arange(len(where), dtype=np.int64)
        self._cache = (k, seq, rank)
        return seq, rank

    # -- queries ---------------------------------------------------------------------
    def locate(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """For samples ``[start, end)`` of the epoch: each one's stream and its position
        in that stream's own order."""
        if not 0 <= start <= end <= self.total:
            raise IndexError(f"samples [{start}, {end}) outside a mixed epoch of {self.total}")
        p = np.arange(start, end, dtype=np.int64)
        if self.mode == "stratified":
            q, o = np.divmod(p, self.unit)
            s = np.searchsorted(self._cum, o, side="right") - 1
            return s, q * self.per_batch[s] + (o - self._cum[s])
        q, o = np.divmod(p, self.unit)
        streams = np.empty(len(p), dtype=np.int64)
        pos = np.empty(len(p), dtype=np.int64)
        i = 0
        while i < len(p):
            k = self._find_block(int(q[i]))
            k0 = self._block_start(k)
            seq, rank = self._deal(k)
            j = int(np.searchsorted(q, k0 + len(seq), side="left"))
            local = q[i:j] - k0
            streams[i:j] = seq[local]
            pos[i:j] = rank[local] * self.unit + o[i:j]
            i = j
        return streams, pos

    def before(self, p: int) -> np.ndarray:
        """How many samples of each stream the first ``p`` samples of the epoch hold."""
        if not 0 <= p <= self.total:
            raise IndexError(f"sample {p} outside a mixed epoch of {self.total}")
        if self.mode == "stratified":
            q, o = divmod(p, self.unit)
            return q * self.per_batch + np.clip(o - self._cum[:-1], 0, self.per_batch)
        if p == self.total:
            return np.asarray(self.counts, dtype=np.int64)
        q, o = divmod(p, self.unit)
        k = self._find_block(q)
        seq, _rank = self._deal(k)
        local = q - self._block_start(k)
        out = self._ticks(k * self.block).copy()
        out += np.bincount(seq[:local], minlength=self.streams)
        out *= self.unit
        out[seq[local]] += o
        return out

    def project(
        self, segments: Sequence[tuple[int, int]], slots: bool = True
    ) -> list[list[tuple[int, int]]]:
        """Each stream's ranges of its own order read by ``segments`` of the epoch (slots
        when ``slots``, else samples), in the same order."""
        return _project(self, segments, slots)


def _project(
    mix: MixOrder | ScheduledMix, segments: Sequence[tuple[int, int]], slots: bool
) -> list[list[tuple[int, int]]]:
    """:meth:`MixOrder.project` of either kind of mix (from its ``before``)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(mix.streams)]
    scale = mix.unit if slots else 1
    for a, b in segments:
        lo, hi = mix.before(a * scale), mix.before(b * scale)
        for s in range(mix.streams):
            if hi[s] > lo[s]:
                out[s].append((int(lo[s]), int(hi[s])))
    return out


Weights = tuple[float, ...]
#: A schedule as given: ``[(step, weights), ...]`` or ``f(epoch, step) -> weights``.
ScheduleSpec = Sequence[tuple[int, Sequence[float]]] | Callable[[int, int], Sequence[float]]


def check_weights(raw: object, streams: int, where: str) -> Weights:
    """``raw`` as the weights of ``streams`` streams: finite numbers >= 0, one of them > 0.

    Raises:
        ValueError: anything else (the message names ``where``).
    """
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise ValueError(f"{where}: weights must be a list of {streams} numbers, got {raw!r}")
    if len(raw) != streams:
        raise ValueError(f"{where}: {len(raw)} weights for {streams} streams")
    out = []
    for w in raw:
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise ValueError(f"{where}: weight {w!r} is not a number")
        if not (math.isfinite(float(w)) and float(w) >= 0):
            raise ValueError(f"{where}: weight {w!r} must be finite and >= 0")
        out.append(float(w))
    if not sum(out) > 0:
        raise ValueError(f"{where}: at least one weight must be > 0")
    return tuple(out)


class Schedule:
    """The weights of a mix's streams by global step (see "Schedules" above).

    Args:
        spec: ``[(step, weights), ...]``, steps strictly increasing from 0: the weights
            of the last entry at or before a step hold at that step; or a callable
            ``f(epoch, step) -> weights``, called for every step of an epoch when the
            epoch's mix is built (it must be a pure function of its arguments).
        streams: the number of streams (each ``weights`` has one per stream).

    Raises:
        ValueError: a malformed list (the message says which entry).
    """

    def __init__(self, spec: ScheduleSpec, streams: int) -> None:
        self.streams = streams
        self.fn: Callable[[int, int], Sequence[float]] | None = None
        self.steps: list[int] = []
        self.weights_at: list[Weights] = []
        if callable(spec):
            self.fn = spec
            return
        if not isinstance(spec, Sequence) or isinstance(spec, (str, bytes)) or not spec:
            raise ValueError("schedule must be a non-empty list of (step, weights) or a callable")
        for i, entry in enumerate(spec):
            if not isinstance(entry, Sequence) or len(entry) != 2:
                raise ValueError(f"schedule[{i}] must be (step, weights), got {entry!r}")
            step, weights = entry
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
                raise ValueError(f"schedule[{i}]: step must be an integer >= 0, got {step!r}")
            if i == 0 and step != 0:
                raise ValueError(f"schedule[0] must be at step 0 (it is at step {step})")
            if i and step <= self.steps[-1]:
                raise ValueError(
                    f"schedule[{i}]: steps must increase ({step} after {self.steps[-1]})"
                )
            self.steps.append(int(step))
            self.weights_at.append(check_weights(weights, streams, f"schedule[{i}]"))

    @property
    def identity(self) -> list[Any] | str:
        """What a resume state records of the schedule (a callable: ``"callable"``)."""
        if self.fn is not None:
            return "callable"
        return [[s, list(w)] for s, w in zip(self.steps, self.weights_at, strict=True)]

    def weights(self, epoch: int, step: int) -> Weights:
        """The weights at global step ``step`` (of epoch ``epoch``)."""
        if self.fn is not None:
            return check_weights(self.fn(epoch, step), self.streams, f"schedule({epoch}, {step})")
        return self.weights_at[bisect.bisect_right(self.steps, step) - 1]

    def pieces(self, epoch: int, first: int, count: int) -> list[tuple[int, int, Weights]]:
        """Runs ``(t0, t1, weights)`` of equal weights covering steps ``first + [0,
        count)`` (``count >= 1``), ``t0``/``t1`` relative to ``first``."""
        out: list[tuple[int, int, Weights]] = []
        if self.fn is None:
            lo = bisect.bisect_right(self.steps, first)
            hi = bisect.bisect_left(self.steps, first + count)
            cuts = [s - first for s in self.steps[lo:hi]]
            bounds = [0, *cuts, count]
            for a, b in itertools.pairwise(bounds):
                out.append((a, b, self.weights(epoch, first + a)))
            return out
        for t in range(count):
            w = self.weights(epoch, first + t)
            if out and out[-1][2] == w:
                out[-1] = (out[-1][0], t + 1, w)
            else:
                out.append((t, t + 1, w))
        return out

    def digest(self, epoch: int, first: int, count: int) -> str:
        """Names the weights of steps ``first + [0, count)`` (what a state of a callable
        schedule's epoch records, so a resume with other weights is refused)."""
        raw = repr([(a, b, w) for a, b, w in self.pieces(epoch, first, max(1, count))])
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _split(n: int, weights: Weights) -> list[int]:
    """``n`` apportioned by ``weights``; a stream of weight 0 gets none."""
    pos = [i for i, w in enumerate(weights) if w > 0]
    out = [0] * len(weights)
    for i, c in zip(pos, apportion(n, [weights[i] for i in pos]), strict=True):
        out[i] = c
    return out


class ScheduledMix:
    """Slots of one mixed epoch whose weights follow a :class:`Schedule`; the same queries
    as :class:`MixOrder` (``slots``, ``total``, ``counts``, ``locate``, ``before``,
    ``project``). See "Schedules" in the module docstring.

    Args:
        total: samples of the epoch (``slots * unit``; a unit mode takes whole batches).
        schedule: the weights by step.
        layout: the split of the slots into steps (``batch``: slots per step).
        mode, batch_size, seed, epoch, block: as :class:`MixOrder`.
    """

    def __init__(
        self,
        total: int,
        schedule: Schedule,
        layout: Layout,
        *,
        mode: str,
        batch_size: int,
        seed: int,
        epoch: int,
        block: int = 1024,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mix mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.mode, self.seed, self.epoch, self.block = mode, seed, epoch, block
        self.streams = schedule.streams
        self.unit = 1 if mode == "random" else batch_size
        self.slots = total // self.unit
        self.layout = layout
        steps = layout.steps(self.slots)
        n = layout.rank_samples(self.slots)
        held = -(-n // layout.batch)  # steps of a rank holding positions
        runs = schedule.pieces(epoch, epoch * steps, max(1, min(held, steps)))
        # Steps past the epoch's last delivered one take its weights (never read).
        runs[-1] = (runs[-1][0], max(held, runs[-1][1]), runs[-1][2])
        nw, b = layout.workers, layout.batch
        spans = worker_spans(n, nw, b) if n else []
        starts: list[int] = []
        counts: list[list[int]] = []
        blocks = min(layout.world, -(-self.slots // n)) if n else 0  # (those holding slots)
        for r in range(blocks):
            lo, length = r * n, min(n, self.slots - r * n)
            for w, (s0, s1) in enumerate(spans):
                # Batch j of worker w's span is step j * nw + w of the rank.
                for t0, t1, wts in runs:
                    j0, j1 = max(0, -(-(t0 - w) // nw)), max(0, -(-(t1 - w) // nw))
                    a, e = max(s0, s0 + j0 * b), min(s1, length, s0 + j1 * b)
                    if a < e:
                        starts.append(lo + a)
                        counts.append(self._piece_counts(e - a, wts))
        if blocks * n < self.slots:  # the tail the split drops: never read
            starts.append(blocks * n)
            counts.append(self._piece_counts(self.slots - blocks * n, runs[-1][2]))
        self._starts = np.asarray([*starts, self.slots], dtype=np.int64)
        per = np.asarray(counts, dtype=np.int64).reshape(len(starts), self.streams)
        self._counts = per
        self._base = np.zeros((len(starts) + 1, self.streams), dtype=np.int64)
        np.cumsum(per, axis=0, out=self._base[1:])
        self.counts = [int(c) for c in self._base[-1]]
        self._orders: dict[int, MixOrder] = {}

    def _piece_counts(self, slots: int, w: Weights) -> list[int]:
        """Samples of each stream in a piece of ``slots`` slots of weights ``w``."""
        if self.mode == "stratified":
            return [c * slots for c in _split(self.unit, w)]
        return [c * self.unit for c in _split(slots, w)]

    @property
    def total(self) -> int:
        """Samples in the epoch (``slots * unit``)."""
        return self.slots * self.unit

    @property
    def pieces(self) -> int:
        return len(self._starts) - 1

    def _piece(self, j: int) -> MixOrder:
        got = self._orders.get(j)
        if got is None:
            if len(self._orders) >= 8:
                self._orders.pop(next(iter(self._orders)))
            got = self._orders[j] = MixOrder(
                self._counts[j].tolist(),
                mode=self.mode,
                batch_size=self.unit,
                seed=self.seed,
                epoch=self.epoch,
                block=self.block,
                salt=(j + 1,),
            )
        return got

    def locate(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """For samples ``[start, end)`` of the epoch: each one's stream and its position
        in that stream's own order."""
        if not 0 <= start <= end <= self.total:
            raise IndexError(f"samples [{start}, {end}) outside a mixed epoch of {self.total}")
        u = self.unit
        streams = np.empty(end - start, dtype=np.int64)
        pos = np.empty(end - start, dtype=np.int64)
        p = start
        while p < end:
            j = int(np.searchsorted(self._starts, p // u, side="right")) - 1
            lo = int(self._starts[j]) * u
            hi = min(end, int(self._starts[j + 1]) * u)
            s, k = self._piece(j).locate(p - lo, hi - lo)
            streams[p - start : hi - start] = s
            pos[p - start : hi - start] = k + self._base[j][s]
            p = hi
        return streams, pos

    def before(self, p: int) -> np.ndarray:
        """How many samples of each stream the first ``p`` samples of the epoch hold."""
        if not 0 <= p <= self.total:
            raise IndexError(f"sample {p} outside a mixed epoch of {self.total}")
        if p == self.total:
            return np.asarray(self.counts, dtype=np.int64)
        j = int(np.searchsorted(self._starts, p // self.unit, side="right")) - 1
        return self._base[j] + self._piece(j).before(p - int(self._starts[j]) * self.unit)

    def project(
        self, segments: Sequence[tuple[int, int]], slots: bool = True
    ) -> list[list[tuple[int, int]]]:
        """As :meth:`MixOrder.project`."""
        return _project(self, segments, slots)


def deal(
    counts: Sequence[int],
    schedule: Schedule | None,
    layout: Layout | None,
    mode: str,
    batch_size: int,
    seed: int,
    epoch: int,
) -> MixOrder | ScheduledMix:
    """Epoch ``epoch`` of a mix of streams taking ``counts`` samples: by its weights
    (:class:`MixOrder`), or, with a ``schedule``, by the weights the schedule gives each
    step of ``layout`` (:class:`ScheduledMix`).

    Raises:
        ValueError: weights a callable schedule returned that are not weights.
    """
    if schedule is None:
        return MixOrder(counts, mode=mode, batch_size=batch_size, seed=seed, epoch=epoch)
    assert layout is not None
    return ScheduledMix(
        sum(counts), schedule, layout, mode=mode, batch_size=batch_size, seed=seed, epoch=epoch
    )


def checked_schedule(
    spec: ScheduleSpec, shares: Sequence[Share], names: Sequence[str], sizes: Sequence[int]
) -> Schedule:
    """The :class:`Schedule` of ``spec`` over streams ``names`` of ``sizes`` samples, taken
    by ``shares``.

    Raises:
        ConfigError: a stream taken by ``repeat=`` or ``choose=`` (a schedule weighs every
            stream), an empty stream, or a schedule that is not one.
    """
    for i, sh in enumerate(shares):
        if not sh.weighted:
            raise ConfigError(
                f"stream {i} of the mix has repeat= or choose=; with a schedule every "
                "stream is weighted by the schedule"
            )
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        if not size:
            raise ConfigError(f"stream {i} ({name}) of a scheduled mix is empty")
    try:
        return Schedule(spec, len(names))
    except ValueError as exc:
        raise ConfigError(f"mix: {exc}") from exc
