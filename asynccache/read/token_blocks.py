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
:mod:`asynccache.read.reader`; torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import ConfigError, DataError
from ..format import Index
from ..sampling.blocks import BlockLayout
from .reader import Reader

__all__ = ["TokenBlocks", "TokenUnits", "copy_blocks"]


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

    def place(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each block: the chunk it starts in, and the byte offset of its first token
        in that chunk's tokens, or -1 when it runs on into the next chunk(s)."""
        starts, offsets = self.layout.locate_many(blocks)
        bounds = self.layout.starts
        inside = offsets + self.block_size <= bounds[starts + 1] - bounds[starts]
        return starts, np.where(inside, offsets * self.dtype.itemsize, -1)

    def assemble_into(
        self, reader: Reader, blocks: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None
    ) -> None:
        """Blocks ``blocks`` copied into ``rows`` (``(n, block_size)`` of the token dtype,
        C order), one copy per token (see :func:`copy_blocks`). Block ``j`` goes to row
        ``at[j]`` (default: row ``j``), so several datasets can fill the rows of one
        batch."""
        if not len(blocks):
            return
        chunks, offsets = self.place(blocks)
        dest = range(len(blocks)) if at is None else at.tolist()
        copy_blocks(
            rows,
            [(self, reader)],
            dest,
            [0] * len(blocks),
            chunks.tolist(),
            offsets.tolist(),
            blocks.tolist(),
        )

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


def copy_blocks(
    rows: np.ndarray,
    sources: list[tuple[TokenUnits, Reader]],
    dest: Any,
    source: list[int],
    chunks: list[int],
    offsets: list[int],
    blocks: list[int],
) -> None:
    """Row ``dest[j]`` of ``rows`` (``(n, block_size)``, C order) becomes block
    ``blocks[j]`` of ``sources[source[j]]``, which starts in chunk ``chunks[j]`` at byte
    ``offsets[j]`` of its tokens (-1: it spans chunks; :meth:`TokenUnits.place`).

    A block inside its chunk is one slice copy from the chunk's mapping, each chunk's
    tokens asked of its reader once per call: a batch's rows come from many chunks (a
    mix's from every stream's), and a few row copies cost less than gathering each
    chunk's rows with several numpy calls. A spanning block is assembled from its pieces.
    """
    if not rows.flags.c_contiguous:
        raise ValueError("copy_blocks: rows must be C-contiguous")
    width = rows.shape[1] * rows.itemsize
    out = rows.reshape(-1).view(np.uint8).data
    held: dict[tuple[int, int], memoryview] = {}
    for r, s, c, o, b in zip(dest, source, chunks, offsets, blocks, strict=True):
        if o < 0:
            units, reader = sources[s]
            rows[r] = units.read(reader, b)
            continue
        v = held.get((s, c))
        if v is None:
            units, reader = sources[s]
            v = held[(s, c)] = reader.chunk_tokens(c).view(np.uint8).data
        at = r * width
        out[at : at + width] = v[o : o + width]
