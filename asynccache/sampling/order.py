"""The order of one epoch: a sequence S of all keys, fixed by (dataset, seed, epoch).

Without shuffle, S is ``0, 1, ..., N-1``. With shuffle, the chunks are permuted, then
consecutive groups of ``window`` chunks are merged and their items shuffled together:
neighbours in S come from several chunks (not one), while a reader at any point of S
needs only about ``window`` chunks at once, so shuffling costs no extra downloads.

S is never materialised whole: :meth:`EpochOrder.keys` builds only the windows that a
requested range of positions touches, so memory is bounded by a window, not by N.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

_SEED_MIX = 0x9E3779B97F4A7C15


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed & (2**63 - 1), epoch, stream, _SEED_MIX & 0xFFFF])


class EpochOrder:
    """Maps positions of the epoch order S to dataset keys.

    Args:
        chunk_sizes: how many keys each chunk holds.
        keys_of: the keys chunk ``c`` holds, in storage order (asked for lazily).
        seed, epoch: the order is a pure function of these and ``chunk_keys``.
        shuffle: permute as described in the module docstring; else keys in order.
        window: how many chunks are mixed together when shuffling.
    """

    def __init__(
        self,
        chunk_sizes: Sequence[int],
        keys_of: Callable[[int], np.ndarray],
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        window: int = 4,
    ) -> None:
        self.total = int(sum(chunk_sizes))
        self.shuffle = shuffle
        self._keys_of = keys_of
        self._seed, self._epoch = seed, epoch
        self._cache: tuple[int, np.ndarray] | None = None
        if not shuffle:
            return
        perm = _rng(seed, epoch, 0).permutation(len(chunk_sizes))
        self._windows = [perm[i : i + max(1, window)] for i in range(0, len(perm), max(1, window))]
        sizes = [sum(chunk_sizes[c] for c in w) for w in self._windows]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()

    def __len__(self) -> int:
        return self.total

    def _window(self, g: int) -> np.ndarray:
        if self._cache is not None and self._cache[0] == g:
            return self._cache[1]
        keys = np.concatenate([self._keys_of(int(c)) for c in self._windows[g]])
        keys = keys[_rng(self._seed, self._epoch, g + 1).permutation(len(keys))]
        self._cache = (g, keys)
        return keys

    def keys(self, start: int, end: int) -> np.ndarray:
        """The keys at positions ``[start, end)`` of S."""
        if not 0 <= start <= end <= self.total:
            raise IndexError(f"positions [{start}, {end}) outside an epoch of {self.total}")
        if not self.shuffle:
            return np.arange(start, end, dtype=np.int64)
        out = []
        g = bisect.bisect_right(self._starts, start) - 1
        pos = start
        while pos < end:
            w0, w1 = self._starts[g], self._starts[g + 1]
            take = min(end, w1)
            out.append(self._window(g)[pos - w0 : take - w0])
            pos = take
            g += 1
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)
