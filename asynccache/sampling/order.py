"""The order of one epoch: a sequence S of units, fixed by (dataset, seed, epoch).

A *unit* is what one position of S reads: an item, or (for token datasets) a fixed-length
block. Units are numbered ``0 .. N-1``; each unit starts in one chunk.

Without shuffle, S is ``0, 1, ..., N-1``. With shuffle, the chunks are permuted, then
consecutive groups of ``window`` chunks are merged and their units shuffled together:
neighbours in S come from several chunks (not one), while a reader at any point of S
needs only about ``window`` chunks at once, so shuffling costs no extra downloads.

:class:`ReadOrder` is the one place that builds "the epoch order of a dataset as read":
on top of :class:`EpochOrder` it takes a seeded subset of whole chunks (``subsample``)
and truncates or wraps the epoch to ``epoch_size`` positions (each further pass over the
data has its own shuffle). Every user of the order (the dataset's readers, the node's read
plan, a mix of datasets) builds it here from the same :class:`OrderSpec`, so what is read
and what is planned, prefetched and evicted always agree.

S is never materialised whole: :meth:`EpochOrder.keys` builds only the windows that a
requested range of positions touches, so memory is bounded by a window, not by N.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

_SEED_MIX = 0x9E3779B97F4A7C15
_SUBSET_STREAM = 0x5B5A  # the rng stream of the subsample (not an epoch's)


def _rng(seed: int, epoch: int, stream: int, lap: int = 0) -> np.random.Generator:
    words = [seed & (2**63 - 1), epoch, stream, _SEED_MIX & 0xFFFF]
    return np.random.default_rng([*words, lap] if lap else words)


@dataclasses.dataclass(frozen=True)
class Spans:
    """Windows of an order: window ``k`` covers positions ``[lo[k], hi[k])`` and its
    chunks are the next ``counts[k]`` entries of ``chunks``."""

    lo: np.ndarray
    hi: np.ndarray
    chunks: np.ndarray
    counts: np.ndarray

    @staticmethod
    def join(parts: Sequence[Spans]) -> Spans:
        if not parts:
            empty = np.empty(0, dtype=np.int64)
            return Spans(empty, empty, empty, empty)
        return Spans(
            np.concatenate([p.lo for p in parts]),
            np.concatenate([p.hi for p in parts]),
            np.concatenate([p.chunks for p in parts]),
            np.concatenate([p.counts for p in parts]),
        )


class EpochOrder:
    """Maps positions of the epoch order S to unit keys.

    Args:
        chunk_sizes: how many units each chunk holds (a sequence or an int array).
        keys_of: the keys chunk ``c`` holds, in storage order (asked for lazily).
        seed, epoch: the order is a pure function of these and ``chunk_keys``.
        shuffle: permute as described in the module docstring; else keys in order.
        window: how many chunks are mixed together when shuffling.
        chunks: the chunks taking part, in storage order (None: all of them).
        lap: the pass over the data within the epoch (a wrapped epoch's later passes
            are shuffled anew; pass 0 is the plain epoch order).
    """

    def __init__(
        self,
        chunk_sizes: Sequence[int] | np.ndarray,
        keys_of: Callable[[int], np.ndarray],
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        window: int = 4,
        chunks: np.ndarray | None = None,
        lap: int = 0,
    ) -> None:
        sizes = np.asarray(chunk_sizes, dtype=np.int64)
        taking = np.arange(len(sizes), dtype=np.int64) if chunks is None else chunks
        self.total = int(sizes[taking].sum())
        self.shuffle = shuffle
        self._keys_of = keys_of
        self._seed, self._epoch, self._lap = seed, epoch, lap
        self._cache: tuple[int, np.ndarray] | None = None
        self._plain = chunks is None and not shuffle  # keys are the positions
        self._sizes = sizes
        if self._plain:
            return
        if shuffle:
            taking = taking[_rng(seed, epoch, 0, lap).permutation(len(taking))]
            step = max(1, window)
        else:
            step = 1
        # Window g is taking[g * step : (g + 1) * step]; built with arrays only, so a
        # million chunks cost milliseconds, not a Python object per chunk.
        self._taking, self._step = taking, step
        wsizes = (
            np.add.reduceat(sizes[taking], np.arange(0, len(taking), step))
            if len(taking)
            else np.empty(0, dtype=np.int64)
        )
        self._starts = np.zeros(len(wsizes) + 1, dtype=np.int64)
        np.cumsum(wsizes, out=self._starts[1:])

    def __len__(self) -> int:
        return self.total

    def spans(self, start: int, end: int) -> Spans:
        """The windows that positions ``[start, end)`` of S touch (see :class:`Spans`):
        positions ``[lo, hi)`` of a window read units of its chunks only (each of them in
        every part of it, when shuffled). Arrays, not a key per position: a plan over a
        million chunks stays flat. A plain order must have its keys in chunk order (as a
        sequential index does): each chunk is then one window."""
        if not 0 <= start <= end <= self.total:
            raise IndexError(f"positions [{start}, {end}) outside an epoch of {self.total}")
        starts = self._plain_starts if self._plain else self._starts
        g0 = int(np.searchsorted(starts, start, side="right")) - 1
        g1 = int(np.searchsorted(starts, end, side="left"))
        g = np.arange(max(g0, 0), max(g1, g0, 0), dtype=np.int64)
        lo = np.maximum(starts[g], start)
        hi = np.minimum(starts[g + 1], end)
        keep = hi > lo
        g, lo, hi = g[keep], lo[keep], hi[keep]
        if self._plain:
            return Spans(lo, hi, g, np.ones(len(g), dtype=np.int64))
        step, taking = self._step, self._taking
        at = g[:, None] * step + np.arange(step, dtype=np.int64)[None, :]
        real = at < len(taking)
        real[real] = self._sizes[taking[at[real]]] > 0
        return Spans(lo, hi, taking[at[real]], real.sum(axis=1))

    @functools.cached_property
    def _plain_starts(self) -> np.ndarray:
        starts = np.zeros(len(self._sizes) + 1, dtype=np.int64)
        np.cumsum(self._sizes, out=starts[1:])
        return starts

    def _window(self, g: int) -> np.ndarray:
        if self._cache is not None and self._cache[0] == g:
            return self._cache[1]
        window = self._taking[g * self._step : (g + 1) * self._step]
        keys = np.concatenate([self._keys_of(int(c)) for c in window])
        if self.shuffle:
            keys = keys[_rng(self._seed, self._epoch, g + 1, self._lap).permutation(len(keys))]
        self._cache = (g, keys)
        return keys

    def keys(self, start: int, end: int) -> np.ndarray:
        """The keys at positions ``[start, end)`` of S."""
        if not 0 <= start <= end <= self.total:
            raise IndexError(f"positions [{start}, {end}) outside an epoch of {self.total}")
        if self._plain:
            return np.arange(start, end, dtype=np.int64)
        out = []
        g = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < end:
            w0, w1 = int(self._starts[g]), int(self._starts[g + 1])
            take = min(end, w1)
            out.append(self._window(g)[pos - w0 : take - w0])
            pos = take
            g += 1
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class OrderSpec:
    """How a dataset's epoch order is made; all of it is part of a resume state.

    Args:
        seed, shuffle, window: see :class:`EpochOrder`.
        subsample: read only a seeded subset of whole chunks holding about this fraction
            of the units (``0 < subsample <= 1``); the same subset on every rank and in
            every epoch (it depends on ``seed`` only). None: every chunk.
        epoch_size: positions per epoch (None: one pass over the units). Fewer truncates
            the epoch; more wraps into further passes, each with its own shuffle.
    """

    seed: int = 0
    shuffle: bool = False
    window: int = 4
    subsample: float | None = None
    epoch_size: int | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {self.window}")
        if self.subsample is not None and not (
            isinstance(self.subsample, (int, float)) and 0 < self.subsample <= 1
        ):
            raise ValueError(f"subsample must be in (0, 1], got {self.subsample!r}")
        if self.epoch_size is not None and not (
            isinstance(self.epoch_size, int) and self.epoch_size >= 0
        ):
            raise ValueError(f"epoch_size must be a non-negative integer, got {self.epoch_size!r}")

    def identity(self) -> tuple[Any, ...]:
        """What two readers must share to read the same epoch order."""
        return (self.seed, self.shuffle, self.window, self.subsample, self.epoch_size)


class Units(Protocol):
    """What a dataset's order is made of: units per chunk, their keys, their chunks."""

    @property
    def units_per_chunk(self) -> np.ndarray: ...

    def keys_of(self, chunk: int) -> np.ndarray:
        """The unit keys chunk ``chunk`` owns (starts), in storage order."""
        ...

    def chunks_of(self, keys: np.ndarray) -> np.ndarray:
        """The chunk each unit starts in (a unit may also touch the chunks after it)."""
        ...


class ItemUnits:
    """Units that are the items of an index (anything with ``chunk_keys`` and
    ``locate_many``, and ``items_per_chunk`` or ``chunks``)."""

    def __init__(self, index: Any) -> None:
        self.index = index

    @property
    def units_per_chunk(self) -> np.ndarray:
        arr = getattr(self.index, "items_per_chunk", None)
        if arr is None:
            arr = np.fromiter((c.items for c in self.index.chunks), dtype=np.int64)
        return np.asarray(arr, dtype=np.int64)

    def keys_of(self, chunk: int) -> np.ndarray:
        return np.asarray(self.index.chunk_keys(chunk), dtype=np.int64)

    def chunks_of(self, keys: np.ndarray) -> np.ndarray:
        return np.asarray(self.index.locate_many(keys)[0], dtype=np.int64)


def subsample_chunks(sizes: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """The chunks of a seeded subset holding at least ``fraction`` of the units, sorted.

    Chunks are taken in a seeded random order until their units reach
    ``ceil(fraction * total)``: whole chunks only, at least one non-empty chunk when any
    exists. Depends on ``(sizes, fraction, seed)`` only: the same on every rank and epoch.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    perm = _rng(seed, 0, _SUBSET_STREAM).permutation(len(sizes))
    want = max(1, math.ceil(fraction * total)) if total else 0
    reached = np.cumsum(sizes[perm]) >= want
    k = int(np.argmax(reached)) + 1 if total else 0
    return np.sort(perm[:k]).astype(np.int64)


class ReadOrder:
    """The epoch order of one dataset as read: the positions ``[0, total)`` of an epoch
    and the unit at each; see the module docstring.

    Args:
        units: the units of the dataset (see :class:`Units`).
        spec: how the order is made.
        epoch: the epoch.
    """

    def __init__(self, units: Units, spec: OrderSpec, epoch: int) -> None:
        self.units, self.spec, self.epoch = units, spec, epoch
        self.sizes = np.asarray(units.units_per_chunk, dtype=np.int64)
        self.chunks: np.ndarray | None = None
        if spec.subsample is not None and spec.subsample < 1:
            self.chunks = subsample_chunks(self.sizes, spec.subsample, spec.seed)
        taking = self.sizes if self.chunks is None else self.sizes[self.chunks]
        self.lap_size = int(taking.sum())
        self.most = int(taking.max()) if len(taking) else 1
        self.total = self.lap_size if spec.epoch_size is None else spec.epoch_size
        if self.total and not self.lap_size:
            raise ValueError(f"epoch_size={self.total} of a dataset without units")
        self._laps: dict[int, EpochOrder] = {}

    def __len__(self) -> int:
        return self.total

    def _lap(self, lap: int) -> EpochOrder:
        order = self._laps.get(lap)
        if order is None:
            if len(self._laps) >= 2:
                self._laps.pop(next(iter(self._laps)))
            s = self.spec
            order = self._laps[lap] = EpochOrder(
                self.sizes,
                self.units.keys_of,
                seed=s.seed,
                epoch=self.epoch,
                shuffle=s.shuffle,
                window=s.window,
                chunks=self.chunks,
                lap=lap,
            )
        return order

    def _stretches(self, start: int, end: int) -> Iterator[tuple[EpochOrder, int, int, int]]:
        """Positions ``[start, end)`` of the epoch as ``(lap order, first, last, base)``:
        stretches ``[first, last)`` of a lap, whose position 0 is ``base`` in the epoch."""
        if not 0 <= start <= end <= self.total:
            raise IndexError(f"positions [{start}, {end}) outside an epoch of {self.total}")
        pos = start
        while pos < end:
            lap, off = divmod(pos, self.lap_size)
            take = min(end - pos, self.lap_size - off)
            yield self._lap(lap), off, off + take, pos - off
            pos += take

    def keys(self, start: int, end: int) -> np.ndarray:
        """The unit keys at positions ``[start, end)`` of the epoch."""
        out = [order.keys(a, b) for order, a, b, _ in self._stretches(start, end)]
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def chunks_of(self, keys: np.ndarray) -> np.ndarray:
        """The chunk each of ``keys`` starts in."""
        return self.units.chunks_of(keys)

    def spans(self, start: int, end: int) -> Spans:
        """:meth:`EpochOrder.spans` over the laps of the epoch (positions of the epoch)."""
        parts = []
        for order, a, b, base in self._stretches(start, end):
            got = order.spans(a, b)
            parts.append(Spans(got.lo + base, got.hi + base, got.chunks, got.counts))
        return Spans.join(parts)

    @property
    def gap(self) -> int:
        """How far apart two reads of one chunk may be and still be one run."""
        return self.spec.window * self.most if self.spec.shuffle else 1
