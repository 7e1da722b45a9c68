"""Bounds on the numbers an index states, checked before anything is sized by them.

An index is input: its counts size arrays and loops further down (a chunk that claims
10^10 items becomes a 74.5 GiB key array in the sampler). So every count is checked to be
a real integer (not a bool, not a float, not a string), from 0 to :data:`MAX_COUNT`, and
to fit the bytes that must hold it: each item of a chunk needs at least its 8-byte entry
in the chunk's offset table (:data:`OFFSET_BYTES`), so ``items <= bytes // 8``; each token
at least one byte, so ``tokens <= bytes``; and no total may pass :data:`MAX_COUNT`, so
int64 sums never wrap.

Invariant: the cost of every check here depends on how many values it is given, never on
what they say. Pure: numbers in, :class:`BadIndexError` out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BadIndexError

#: The largest count or size an index may state, and the largest total of them: far past
#: any real dataset (4.6 EB), and twice under int64's limit, so sums of two never wrap.
MAX_COUNT = 1 << 62
#: The least bytes each item takes in its chunk: its entry in the offset table.
OFFSET_BYTES = 8


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def count(value: Any, field: str, where: str, *, least: int = 0) -> int:
    """``value`` when it is an int (not a bool) from ``least`` to :data:`MAX_COUNT`.

    Raises:
        BadIndexError: naming ``where`` and ``field``.
    """
    if type(value) is not int or not least <= value <= MAX_COUNT:
        raise BadIndexError(
            f"{where}: {field} must be an integer from {least} to 2**62, got {_shown(value)}"
        )
    return value


def optional_count(value: Any, field: str, where: str) -> int | None:
    """:func:`count`, with None allowed (an absent fact)."""
    return None if value is None else count(value, field, where)


def fits(items: int, size: int, field: str, where: str) -> None:
    """Refuse ``items`` items in a chunk of ``size`` bytes: more than its offset table holds.

    Raises:
        BadIndexError: naming ``where`` and ``field`` (the chunk's).
    """
    if items > size // OFFSET_BYTES:
        raise BadIndexError(
            f"{where}: {field}: {items} items can't be in {size} bytes of chunks (each "
            f"item takes at least its {OFFSET_BYTES}-byte offset entry)"
        )


def tokens_fit(tokens: int, size: int, field: str, where: str) -> None:
    """Refuse more tokens than a chunk of ``size`` bytes has bytes."""
    if tokens > size:
        raise BadIndexError(f"{where}: {field}: {tokens} tokens can't be in {size} bytes of chunks")


def total(values: np.ndarray, field: str, where: str) -> int:
    """The exact sum of non-negative int64 ``values``, refused past :data:`MAX_COUNT`.

    Summed first in float64 (which cannot wrap; its rounding is far below the margin
    between :data:`MAX_COUNT` and int64's limit), then exactly in int64 once that is safe.

    Raises:
        BadIndexError: the sum passes :data:`MAX_COUNT` (naming ``field``).
    """
    if not len(values):
        return 0
    if float(np.sum(values, dtype=np.float64)) > MAX_COUNT:
        raise BadIndexError(f"{where}: {field} add up to more than 2**62")
    got = int(np.sum(values, dtype=np.int64))
    if got > MAX_COUNT:
        raise BadIndexError(f"{where}: {field} add up to more than 2**62")
    return got


def columns_fit(
    items: np.ndarray, sizes: np.ndarray, tokens: np.ndarray | None, where: str
) -> None:
    """:func:`fits` and :func:`tokens_fit` for every chunk of a sidecar's columns
    (non-negative int64 arrays), and their totals within :data:`MAX_COUNT`.

    Raises:
        BadIndexError: naming the first chunk at fault, by number.
    """
    if not len(items):
        return
    for field, values in (("items", items), ("bytes", sizes), ("tokens", tokens)):
        if values is not None and int(values.max()) > MAX_COUNT:
            c = int(np.argmax(values > MAX_COUNT))
            raise BadIndexError(f"{where}: chunk {c}: {field} is past 2**62")
    over = items > sizes // OFFSET_BYTES
    if over.any():
        c = int(np.argmax(over))
        fits(int(items[c]), int(sizes[c]), f"chunk {c} items", where)
    if tokens is not None:
        over = tokens > sizes
        if over.any():
            c = int(np.argmax(over))
            tokens_fit(int(tokens[c]), int(sizes[c]), f"chunk {c}", where)
    total(items, "the chunks' items", where)
    total(sizes, "the chunks' bytes", where)
    if tokens is not None:
        total(tokens, "the chunks' tokens", where)
