"""``TokenBlocks``: read a token dataset as fixed-length blocks of its concatenated tokens.

A token dataset (written with ``tokens="uint16"``, docs/tokens.md) stores each document
as raw tokens, contiguous within a chunk. ``TokenBlocks(block_size=L)`` makes the units
of an epoch the blocks of ``L`` tokens of the concatenated stream instead of the
documents: ``StreamingDataset(url, item_loader=TokenBlocks(block_size=2049))``.

* A block inside one chunk is a view of the mapped chunk (zero-copy).
* A block that runs past the end of its chunk is assembled with one copy from the
  chunks it touches (it is never dropped); only the tail of the whole stream, fewer than
  ``L`` tokens, is not a block.
* The number of blocks is known from the index (each chunk's token count), before any
  chunk is opened.

Layer: above :mod:`asynccache.format`, :mod:`asynccache.sampling` and
:mod:`asynccache.reader`; torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import ConfigError, DataError
from .format import Index
from .reader import Reader
from .sampling.blocks import BlockLayout

__all__ = ["TokenBlocks", "TokenUnits"]


class TokenBlocks:
    """The item loader of a token dataset: units are blocks of ``block_size`` tokens.

    Args:
        block_size: tokens per block (for a language model, the context length plus one
            for the shifted target, e.g. 2049).

    Raises:
        ConfigError: ``block_size`` is not a positive integer.
    """

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError(
                f"TokenBlocks: block_size must be a positive integer, got {block_size!r}"
            )
        self.block_size = block_size

    @property
    def name(self) -> str:
        """What a resume state records: a state saved with another block size is refused."""
        return f"tokens:{self.block_size}"

    def bind(self, index: Index, where: str = "dataset") -> TokenUnits:
        """The blocks of the dataset ``index`` describes.

        Raises:
            DataError: the dataset was not written as tokens (no token counts in its index).
        """
        return TokenUnits(index, self.block_size, where)

    def __repr__(self) -> str:
        return f"TokenBlocks(block_size={self.block_size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenBlocks) and other.block_size == self.block_size

    def __hash__(self) -> int:
        return hash(("TokenBlocks", self.block_size))


class TokenUnits:
    """The blocks of one token dataset: per-chunk unit counts, unit keys, and reading.

    The unit keys are block numbers ``0 .. len - 1``; chunk ``c`` owns the blocks that
    start in it (:class:`~asynccache.sampling.blocks.BlockLayout`).
    """

    def __init__(self, index: Index, block_size: int, where: str = "dataset") -> None:
        tokens = index.tokens_per_chunk
        dtype = index.config.get("token_dtype")
        if tokens is None or dtype is None:
            raise DataError(
                f"{where}: not a token dataset (its index has no token counts); write it "
                "with tokens='uint16' (or another integer dtype) to read it as TokenBlocks"
            )
        self.index = index
        self.dtype = np.dtype(str(dtype)).newbyteorder("<")
        self.layout = BlockLayout(tokens, block_size)
        self.block_size = block_size

    def __len__(self) -> int:
        return self.layout.count

    @property
    def total_tokens(self) -> int:
        return self.layout.total_tokens

    @property
    def units_per_chunk(self) -> np.ndarray:
        """Blocks starting in each chunk (int64)."""
        return self.layout.blocks_per_chunk

    def keys_of(self, chunk: int) -> np.ndarray:
        """The blocks chunk ``chunk`` owns, in storage order."""
        return self.layout.keys_of(chunk)

    def chunks_of(self, units: np.ndarray) -> np.ndarray:
        """The chunk each block starts in."""
        return self.layout.chunks_of(units)

    def last_chunks(self, units: np.ndarray) -> np.ndarray:
        """The last chunk each block touches (a block may run into the next chunks)."""
        return self.layout.last_chunks(units)

    def read_many(self, reader: Reader, blocks: np.ndarray) -> Iterator[Any]:
        """Blocks ``blocks`` in order, read as :meth:`read` does.

        Each chunk's tokens are asked of ``reader`` once per call (a block is a view of
        them, which keeps their mapping alive), not once per block: a shuffled window
        interleaves a few chunks, and the per-block cost is then a slice.
        """
        L = self.block_size
        starts, offsets = self.layout.locate_many(blocks)
        lasts = self.layout.last_chunks(blocks)
        held: dict[int, np.ndarray] = {}
        for b, c, off, last in zip(
            blocks.tolist(), starts.tolist(), offsets.tolist(), lasts.tolist(), strict=True
        ):
            if c == last:
                tokens = held.get(c)
                if tokens is None:
                    tokens = held[c] = reader.chunk_tokens(c)
                yield tokens[off : off + L]
            else:
                yield self.read(reader, b)

    def assemble_into(
        self, reader: Reader, blocks: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None
    ) -> None:
        """Blocks ``blocks`` copied into ``rows`` (``(n, block_size)`` of the token dtype,
        C order), one copy per token: the blocks inside a chunk are rows of one reshape of
        its tokens (they start ``block_size`` apart), so each chunk's share is one gather;
        a block that spans chunks is assembled from its pieces. Block ``j`` goes to row
        ``at[j]`` (default: row ``j``; increasing), so several datasets can fill the rows
        of one batch."""
        if not len(blocks):
            return
        L = self.block_size
        w = self.dtype.itemsize
        out = rows.view(np.uint8)  # (n, L * w)
        dest = np.arange(len(blocks), dtype=np.int64) if at is None else at
        starts, offsets = self.layout.locate_many(blocks)
        bounds = self.layout.starts
        inside = offsets + L <= bounds[starts + 1] - bounds[starts]  # (not into the next)
        row_of = offsets // L  # a chunk's blocks: rows of its tokens from offset % L on
        by_chunk = np.argsort(starts, kind="stable")  # (each chunk's blocks in batch order)
        ends = [*(np.flatnonzero(np.diff(starts[by_chunk])) + 1).tolist(), len(blocks)]
        spanning = not bool(inside.all())
        a = 0
        for b in ends:
            g, a = by_chunk[a:b], b
            if spanning:
                g = g[inside[g]]
                if not len(g):
                    continue
            src = reader.chunk_tokens(int(starts[g[0]]))
            r = int(offsets[g[0]]) % L
            view = src[r : r + (len(src) - r) // L * L].view(np.uint8).reshape(-1, L * w)
            d = dest[g]
            k = len(g)
            if k == 1:
                out[int(d[0])] = view[int(row_of[g[0]])]
            elif int(d[-1]) - int(d[0]) == k - 1:  # consecutive rows: gather in place
                rows_k = out[int(d[0]) : int(d[0]) + k]
                np.take(view, row_of[g], axis=0, out=rows_k, mode="clip")  # (unbuffered)
            else:
                out[d] = view[row_of[g]]
        for j in np.flatnonzero(~inside).tolist():
            rows[int(dest[j])] = self.read(reader, int(blocks[j]))

    def read(self, reader: Reader, block: int) -> Any:
        """Block ``block``: a view of its chunk's mapping, or one copy when it spans chunks."""
        pieces = self.layout.pieces(int(block))
        if len(pieces) == 1:
            c, a, b = pieces[0]
            return reader.chunk_tokens(c)[a:b]
        out = np.empty(self.block_size, self.dtype)
        pos = 0
        for c, a, b in pieces:
            out[pos : pos + b - a] = reader.chunk_tokens(c)[a:b]
            pos += b - a
        return out
