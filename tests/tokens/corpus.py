"""Token corpora for the token tests: documents written as a token dataset.

In the *position corpus* token ``p`` of the concatenated stream has the value ``p``
(uint32), so a block names itself: block ``b`` is ``arange(b * L, (b + 1) * L)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asynccache.format import Index
from asynccache.write.writer import ChunkWriter, merge_dir

#: Document lengths of the position corpus (empty and long documents included).
LENGTHS = [(i * 7919) % 900 for i in range(60)]
STARTS = np.concatenate([[0], np.cumsum(LENGTHS)]).tolist()
TOTAL = STARTS[-1]


def position_doc(i: int) -> np.ndarray:
    """Document ``i`` of the position corpus (module level: optimize pickles it)."""
    return np.arange(STARTS[i], STARTS[i + 1], dtype=np.uint32)


def documents(lengths: Sequence[int], seed: int = 0, high: int = 60000) -> list[np.ndarray]:
    """Documents of the given lengths; token values are random below ``high``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, n).astype(np.int64) for n in lengths]


def write_tokens(
    directory: str,
    docs: Sequence[np.ndarray],
    *,
    chunk_bytes: int | None = None,
    chunk_size: int | None = None,
    dtype: str = "uint16",
) -> Index:
    """Write ``docs`` (document i under key i) as a token dataset with one writer; returns
    its index."""
    w = ChunkWriter(directory, 0, chunk_bytes=chunk_bytes, chunk_size=chunk_size, tokens=dtype)
    for i, d in enumerate(docs):
        w.add(i, d)
    w.finish()
    return merge_dir(directory, [0])


def block_numbers(batch: object, block_size: int) -> list[int]:
    """The block numbers of a batch of position-corpus blocks, each checked whole."""
    rows = np.asarray(batch)
    assert rows.ndim == 2 and rows.shape[1] == block_size
    firsts = rows[:, 0].astype(np.int64)
    assert all(f % block_size == 0 for f in firsts.tolist()), "a block starts on a block boundary"
    want = firsts[:, None] + np.arange(block_size)
    assert np.array_equal(rows.astype(np.int64), want), "a block is its stream tokens, in order"
    return (firsts // block_size).tolist()
