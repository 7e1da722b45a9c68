"""Token corpora for the token tests: documents written as a token dataset."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asynccache.writer import ChunkWriter, merge_dir


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
) -> None:
    """Write ``docs`` (document i under key i) as a token dataset with one writer."""
    w = ChunkWriter(directory, 0, chunk_bytes=chunk_bytes, chunk_size=chunk_size, tokens=dtype)
    for i, d in enumerate(docs):
        w.add(i, d)
    w.finish()
    merge_dir(directory, [0])
