"""Reading the units of one dataset (items, or token blocks) for an epoch's reader.

:class:`UnitReader` is what a dataset's epoch loop (and each stream of a mix) asks of the
data: where units lie (their chunks), the units themselves one by one, whether their
chunks are in the cache, and the forms of mapped chunks that batch assembly copies from
(:mod:`.batchread`). It holds no position: the order and split are the caller's.

Invariant: a form found for one mapping of a chunk file is used only with a mapping of
that same file (see :class:`~.batchread.FormCache`); items built from forms equal what
``read`` decodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..format import Index
from .batchread import ChunkForms, FormCache
from .reader import Reader
from .source import DatasetSource
from .token_blocks import TokenUnits

__all__ = ["UnitReader"]

_ITEMS_BYTES = 8 << 20  # items built ahead of the one handed out, about (see _items)
_ITEMS_MAX = 512  # and at most this many


class UnitReader:
    """Units of one dataset: items of its index, or blocks of ``blocks``."""

    def __init__(
        self,
        index: Index,
        reader: Reader,
        source: DatasetSource,
        blocks: TokenUnits | None,
        max_forms: int,
    ) -> None:
        self.index, self.reader, self.source, self.blocks = index, reader, source, blocks
        self.max_forms = max_forms
        self._forms = FormCache(max_forms, objects=True)  # over the batch mappings
        self._item_forms = FormCache(max_forms, objects=True)  # over the items' mappings
        # Positions _items takes at a time: about _ITEMS_BYTES of items.
        mean = int(index.bytes_per_chunk.sum()) // max(1, int(index.items_per_chunk.sum()))
        self._window = max(1, min(_ITEMS_MAX, _ITEMS_BYTES // max(1, mean)))

    # -- where units lie -----------------------------------------------------------
    def chunks_of(self, keys: np.ndarray) -> np.ndarray:
        """The chunk each unit of ``keys`` starts in."""
        if self.blocks is not None:
            return self.blocks.chunks_of(keys)
        return self.index.locate_many(keys)[0]

    def all_landed(self, keys: np.ndarray) -> bool:
        """Every chunk units ``keys`` read (a token block's last chunk too) is cached."""
        if self.blocks is not None:
            first, last = self.blocks.chunks_of(keys), self.blocks.last_chunks(keys)
            pairs = zip(first.tolist(), last.tolist(), strict=True)
            chunks = {c for a, b in pairs for c in range(a, b + 1)}
        else:
            chunks = set(self.index.locate_many(keys)[0].tolist())
        return all(self.source.landed(c) for c in chunks)

    def reads_by_range(self, keys: np.ndarray) -> bool:
        """Some of units ``keys`` are in chunks not in the cache (read by range)."""
        return self.source.remote and not self.all_landed(keys)

    # -- units one by one ----------------------------------------------------------
    def read(self, key: int) -> Any:
        """Unit ``key`` (random access: its chunk is fetched on demand)."""
        if self.blocks is not None:
            if not 0 <= key < len(self.blocks):
                raise IndexError(f"block {key} is out of range for {len(self.blocks)} blocks")
            return self.blocks.read(self.reader, key)
        return self.reader[key]

    def read_units(self, keys: np.ndarray) -> tuple[np.ndarray, Iterator[Any]]:
        """The chunk each unit of ``keys`` starts in, and the units read one by one (the
        first batch's items not cached are read by range, in one round)."""
        if self.blocks is not None:
            return self.blocks.chunks_of(keys), self.blocks.read_many(self.reader, keys)
        chunks, positions = self.index.locate_many(keys)
        self.reader.expect(chunks, positions)
        return chunks, self._items(chunks, positions)

    def _items(self, chunks: np.ndarray, positions: np.ndarray) -> Iterator[Any]:
        """The items at ``positions`` of ``chunks``, built from each chunk's learned forms
        where they have one (no header parsed per item), else decoded one by one.

        A window of positions at a time, each chunk's items of the window built from one
        call when the window first reaches that chunk: a shuffled order hops between
        the chunks of its shuffle window at almost every item, and a call per run of one
        or two items cost more than the items (docs/performance.md, "The per-item
        path"). The window holds about :data:`_ITEMS_BYTES` of items."""
        window = self._window
        for w in range(0, len(chunks), window):
            cs, ps = chunks[w : w + window], positions[w : w + window]
            built: dict[int, Iterator[Any] | None] = {}
            for c, p in zip(cs.tolist(), ps.tolist(), strict=True):
                if c not in built:
                    built[c] = self._chunk_items(c, ps[cs == c])
                got = built[c]
                # One by one: an item read by range is handed out before the read of the
                # next one waits for its chunk.
                yield next(got) if got is not None else self.reader.read(c, p)

    def _chunk_items(self, c: int, positions: np.ndarray) -> Iterator[Any] | None:
        """Items ``positions`` of chunk ``c`` built from its forms, in that order; None
        when they have none, or the chunk is read by range."""
        if self.reader.by_range(c):
            return None
        mm, offsets = self.reader.item_mapping(c)
        return self._item_forms.get(c, mm, offsets).items(positions)

    def items(self, keys: np.ndarray) -> list[Any]:
        """Units ``keys``, as a list."""
        return list(self.read_units(keys)[1])

    def located(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """For item keys: each item's chunk and position in it, and whether any of them
        was read by range (a first batch over chunks not cached: no mapped chunk to
        assemble from). The range reads of the first batch are sent here (a chunk's items
        all or none: the batch waits for its last item)."""
        chunks, positions = self.index.locate_many(keys)
        self.reader.expect(chunks, positions, whole=True)
        by_range = any(self.reader.by_range(c) for c in dict.fromkeys(chunks.tolist()))
        return chunks, positions, by_range

    # -- batch assembly ------------------------------------------------------------
    def chunk_forms(self, chunk: int) -> ChunkForms:
        """The forms of ``chunk``'s items, for :func:`~.batchread.assemble_into`."""
        mm, offsets = self.reader.mapped(chunk)
        return self._forms.get(chunk, mm, offsets)

    def forget_forms(self) -> None:
        """Let go of the chunks' mappings the forms hold (the forms themselves are kept for
        the next mapping of the same files)."""
        self._forms.clear()
        self._item_forms.clear()

    # -- lifetime ------------------------------------------------------------------
    def skip_range_reads(self) -> None:
        """Read nothing by range this epoch, and send the epoch plan's prefetch hint now
        (a reader whose first batch the main process built)."""
        self.reader.set_range_budget(0)
        self.source.send_hint()

    def close(self) -> None:
        """Drop the forms and the reader's mappings and pins (reopened if used again)."""
        self.forget_forms()
        self.reader.close()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()  # (a FormCache pickles its templates, not its mappings)
