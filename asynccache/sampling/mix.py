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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["MODES", "MixOrder", "Share", "apportion", "stream_counts"]

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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mix mode must be one of {', '.join(MODES)}; got {mode!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.mode, self.seed, self.epoch = mode, seed, epoch
        self.streams = len(counts)
        self.unit = 1 if mode == "random" else batch_size  # samples per slot
        self.block = max(1, block)
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
        rng = np.random.default_rng([self.seed & (2**63 - 1), self.epoch, _MIX_STREAM, k])
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
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.streams)]
        scale = self.unit if slots else 1
        for a, b in segments:
            lo, hi = self.before(a * scale), self.before(b * scale)
            for s in range(self.streams):
                if hi[s] > lo[s]:
                    out[s].append((int(lo[s]), int(hi[s])))
        return out
