"""Fixed-length token blocks over the concatenated tokens of a dataset's chunks.

The token stream is the chunks' tokens in chunk order (within a chunk, in storage order).
Block ``b`` covers stream tokens ``[b * L, (b + 1) * L)``; the tail of fewer than ``L``
tokens is not a block. A block *belongs* to the chunk it starts in, so a chunk's units
are the blocks starting there, numbered in storage order: block numbers are the unit
keys of an epoch order, exactly as item keys are for a dataset of items. A block may run
on into the next chunk(s): :meth:`BlockLayout.last_chunks` names the last one it touches.

Pure: arrays in, arrays out; the per-chunk token counts come from the index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["BlockLayout"]


class BlockLayout:
    """Where each block of ``block_size`` tokens lies, given the tokens of each chunk.

    Args:
        tokens_per_chunk: how many tokens each chunk holds (chunks may be empty).
        block_size: tokens per block, ``L >= 1``.
    """

    def __init__(self, tokens_per_chunk: Sequence[int] | np.ndarray, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        t = np.asarray(tokens_per_chunk, dtype=np.int64)
        if t.ndim != 1 or np.any(t < 0):
            raise ValueError("tokens_per_chunk must be a 1-D array of non-negative counts")
        self.block_size = int(block_size)
        #: ``starts[c]``: the stream position of chunk ``c``'s first token; ``starts[-1]``
        #: is the total.
        self.starts = np.concatenate([[0], np.cumsum(t, dtype=np.int64)])
        self.total_tokens = int(self.starts[-1])
        self.count = self.total_tokens // self.block_size
        # first_block[c]: the first block starting at or after chunk c's first token.
        L = self.block_size
        self._first = np.minimum(-(-self.starts // L), self.count)
        #: Blocks starting in each chunk (the chunk's units), int64.
        self.blocks_per_chunk = np.diff(self._first)
        self.starts.flags.writeable = False
        self._first.flags.writeable = False
        self.blocks_per_chunk.flags.writeable = False

    def __len__(self) -> int:
        return self.count

    def keys_of(self, chunk: int) -> np.ndarray:
        """The blocks starting in ``chunk``, in storage order."""
        return np.arange(self._first[chunk], self._first[chunk + 1], dtype=np.int64)

    def _check(self, blocks: np.ndarray) -> np.ndarray:
        b = np.asarray(blocks, dtype=np.int64)
        if b.size and (int(b.min()) < 0 or int(b.max()) >= self.count):
            raise IndexError(f"block out of range for {self.count} blocks")
        return b

    def chunks_of(self, blocks: np.ndarray) -> np.ndarray:
        """The chunk each block starts in."""
        b = self._check(blocks)
        return np.searchsorted(self.starts, b * self.block_size, side="right") - 1

    def locate_many(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk each block starts in, its first token's offset in that chunk)``."""
        b = self._check(blocks)
        first = b * self.block_size
        c = np.searchsorted(self.starts, first, side="right") - 1
        return c, first - self.starts[c]

    def last_chunks(self, blocks: np.ndarray) -> np.ndarray:
        """The last chunk each block touches (its start chunk unless it spans a boundary)."""
        b = self._check(blocks)
        return np.searchsorted(self.starts, (b + 1) * self.block_size - 1, side="right") - 1

    def pieces(self, block: int) -> list[tuple[int, int, int]]:
        """``(chunk, start, stop)`` token ranges, within each chunk, that make up ``block``
        in order; one piece for a block inside one chunk. Empty chunks are skipped."""
        if not 0 <= block < self.count:
            raise IndexError(f"block {block} out of range for {self.count} blocks")
        pos = block * self.block_size
        end = pos + self.block_size
        c = int(np.searchsorted(self.starts, pos, side="right")) - 1
        out = []
        while pos < end:
            c0, c1 = int(self.starts[c]), int(self.starts[c + 1])
            if c1 > pos:
                stop = min(end, c1)
                out.append((c, pos - c0, stop - c0))
                pos = stop
            c += 1
        return out
