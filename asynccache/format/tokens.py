"""Token items: a document is a 1-D integer array stored as raw little-endian tokens.

A *token chunk* (flag :data:`FLAG_TOKENS` in the chunk header, see :mod:`.chunk`) holds
its items as bare tokens, packed with no header and no padding: item ``i`` is bytes
``[off[i], off[i+1])`` of the file, and the tokens of all items are one contiguous run
from ``off[0]`` (64-aligned) to the end of the file. So any range of a chunk's tokens is
a view of the mapped file. The token dtype is recorded in the header's flags (bits 8-15,
a code from :data:`TOKEN_DTYPES`) and in ``index.json``'s ``config.token_dtype``.

Pure module: arrays in, bytes out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, SerializationError, UnsupportedVersionError

#: Header flag bit: the chunk's items are raw tokens.
FLAG_TOKENS = 1
#: Token dtypes a chunk can hold; the header stores ``code = position + 1`` in bits 8-15.
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
_CODE_SHIFT = 8


def token_dtype(dtype: Any) -> np.dtype[Any]:
    """The little-endian numpy dtype for a token dtype name or object.

    Raises:
        ConfigError: not one of :data:`TOKEN_DTYPES`.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(
            f"tokens={dtype!r} is not a dtype; use one of {', '.join(TOKEN_DTYPES)}"
        ) from exc
    if dt.name not in TOKEN_DTYPES:
        raise ConfigError(f"tokens={dtype!r}: token dtype must be one of {', '.join(TOKEN_DTYPES)}")
    return dt.newbyteorder("<")


def flags_for(dtype: np.dtype[Any]) -> int:
    """The chunk header flags of a token chunk of ``dtype``."""
    return FLAG_TOKENS | ((TOKEN_DTYPES.index(dtype.name) + 1) << _CODE_SHIFT)


def dtype_of_flags(flags: int, where: str) -> np.dtype[Any] | None:
    """The token dtype a chunk header's ``flags`` name; None for a chunk of items.

    Raises:
        UnsupportedVersionError: unknown flag bits or dtype code (a newer writer), naming
            ``where``.
    """
    if flags & ~(FLAG_TOKENS | (0xFF << _CODE_SHIFT)):
        raise UnsupportedVersionError(
            f"{where}: chunk header flags {flags:#x} hold bits this release does not know; "
            "upgrade asynccache"
        )
    code = (flags >> _CODE_SHIFT) & 0xFF
    if not flags & FLAG_TOKENS:
        if code:
            raise UnsupportedVersionError(
                f"{where}: chunk header flags {flags:#x} name a token dtype without the "
                "token flag; this release can't read it"
            )
        return None
    if not 1 <= code <= len(TOKEN_DTYPES):
        raise UnsupportedVersionError(
            f"{where}: token chunk names dtype code {code}, which this release does not know"
        )
    return np.dtype(TOKEN_DTYPES[code - 1]).newbyteorder("<")


def encode_tokens(item: Any, dtype: np.dtype[Any]) -> list[memoryview | bytes]:
    """The bytes of one document: ``item`` (1-D integers) as little-endian ``dtype``.

    Accepts a numpy array, a list of ints or anything ``numpy.asarray`` takes (a CPU
    torch tensor). Values are checked to fit ``dtype``; no copy when ``item`` already
    is a contiguous array of that dtype.

    Raises:
        SerializationError: not a 1-D integer sequence, or a value that ``dtype`` can't hold.
    """
    try:
        arr = np.asarray(item)
    except Exception as exc:
        raise SerializationError(
            f"a token item must be a 1-D integer array, got {type(item).__name__} ({exc})"
        ) from exc
    if arr.ndim != 1:
        raise SerializationError(
            f"a token item must be a 1-D integer array, got {arr.ndim} dimensions "
            f"({type(item).__name__} of shape {arr.shape})"
        )
    if arr.size == 0:
        return []
    if arr.dtype.kind not in "iu":
        raise SerializationError(
            f"a token item must hold integers, got dtype {arr.dtype} ({type(item).__name__})"
        )
    if not np.can_cast(arr.dtype, dtype, "safe"):
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise SerializationError(
                f"token value {bad} does not fit tokens={dtype.name} "
                f"(range {info.min}..{info.max}); write with a wider token dtype"
            )
    out = np.ascontiguousarray(arr, dtype=dtype)
    return [memoryview(out.data).cast("B")]
