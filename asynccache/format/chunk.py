"""The chunk file: many items, one self-describing binary file.

Byte layout (little-endian)::

    offset  size        field
    0       8           magic  b"ACCHUNK\\n"
    8       4           u32 format version (1)
    12      4           u32 flags (0: items; bit 0 and a dtype code: tokens, see tokens.py)
    16      8           u64 item count N
    24      8*(N+1)     u64 offsets: item i is bytes [off[i], off[i+1]); off[N] == file size
    ...                 zero padding to 64
    off[0]              item 0 (see items.py), each item starts on a 64-byte boundary

In a token chunk the items are raw little-endian tokens packed with no padding, so the
tokens of the whole chunk are the contiguous bytes ``[off[0], off[N])``.

A chunk is valid only if its size equals ``off[N]``: a truncated file is always detected.
Pure module: it builds bytes and parses buffers, it does no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ..errors import BadMagicError, TruncatedChunkError, UnsupportedVersionError
from .items import align, encoded_size
from .tokens import dtype_of_flags

MAGIC = b"ACCHUNK\n"
VERSION = 1
_HEAD = struct.Struct("<8sIIQ")
HEADER_BYTES = _HEAD.size


def items_start(count: int) -> int:
    """Offset of the first item in a chunk of ``count`` items."""
    return align(HEADER_BYTES + 8 * (count + 1))


def build(
    encoded_items: Iterable[list[memoryview | bytes]], flags: int = 0
) -> Iterator[memoryview | bytes]:
    """Yield the pieces of a chunk file holding ``encoded_items`` (from ``items.encode``,
    or from ``tokens.encode_tokens`` with ``flags=tokens.flags_for(dtype)``)."""
    items = list(encoded_items)
    offsets = np.empty(len(items) + 1, dtype="<u8")
    pos = items_start(len(items))
    for i, pieces in enumerate(items):
        offsets[i] = pos
        pos += encoded_size(pieces)
    offsets[len(items)] = pos
    yield _HEAD.pack(MAGIC, VERSION, flags, len(items))
    yield offsets.tobytes()
    yield b"\0" * (items_start(len(items)) - HEADER_BYTES - offsets.nbytes)
    for pieces in items:
        yield from pieces


def header_offsets(buf: Any, count: int, size: int, name: str) -> np.ndarray:
    """The item offsets of a chunk of items, parsed from its first ``items_start(count)``
    bytes alone (a range read of the header, before the chunk itself is here).

    ``count`` and ``size`` are the index's: the header must agree with them.

    Raises:
        BadMagicError, UnsupportedVersionError, TruncatedChunkError: naming ``name``;
            also for a token chunk (its items are not read this way).
    """
    if len(buf) < items_start(count):
        raise TruncatedChunkError(
            f"{name}: {len(buf)} bytes can't hold the header of {count} items"
        )
    magic, version, flags, n = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadMagicError(f"{name}: not an asynccache chunk (bad magic bytes {magic!r})")
    if version != VERSION or flags != 0:
        raise UnsupportedVersionError(f"{name}: version {version} flags {flags:#x}: not items")
    offsets = np.frombuffer(buf, dtype="<u8", count=count + 1, offset=HEADER_BYTES)
    offsets = offsets.astype(np.int64)
    if (
        n != count
        or int(offsets[-1]) != size
        or (count and int(offsets[0]) < HEADER_BYTES + 8 * (count + 1))
        or np.any(np.diff(offsets) < 0)
    ):
        raise TruncatedChunkError(f"{name}: header does not match the index ({count} items)")
    return offsets


class ChunkView:
    """Parsed header of a chunk held in a buffer (an mmap); item ``i`` spans ``span(i)``.

    ``token_dtype`` is the dtype of a token chunk (None for a chunk of items); its tokens
    are ``tokens`` elements from byte ``token_start``.

    Raises on construction:
        BadMagicError, UnsupportedVersionError, TruncatedChunkError: naming ``name``.
    """

    def __init__(self, buf: Any, name: str) -> None:
        size = len(buf)
        if size < HEADER_BYTES:
            if size < len(MAGIC) and bytes(buf[:size]) != MAGIC[:size]:
                raise BadMagicError(f"{name}: not an asynccache chunk (bad magic bytes)")
            raise TruncatedChunkError(f"{name}: {size} bytes is shorter than a chunk header")
        magic, version, flags, count = _HEAD.unpack_from(buf, 0)
        if magic != MAGIC:
            raise BadMagicError(f"{name}: not an asynccache chunk (bad magic bytes {magic!r})")
        if version != VERSION:
            raise UnsupportedVersionError(
                f"{name}: chunk format version {version} is not supported (this release "
                f"reads version {VERSION}); upgrade asynccache or rewrite the dataset"
            )
        table_end = HEADER_BYTES + 8 * (count + 1)
        if table_end > size:
            raise TruncatedChunkError(
                f"{name}: {size} bytes can't hold the offsets table of {count} items"
            )
        offsets = np.frombuffer(buf, dtype="<u8", count=count + 1, offset=HEADER_BYTES)
        if int(offsets[-1]) != size:
            raise TruncatedChunkError(
                f"{name}: file has {size} bytes but its header says {int(offsets[-1])}"
            )
        if count and (int(offsets[0]) < table_end or np.any(np.diff(offsets.astype(np.int64)) < 0)):
            raise TruncatedChunkError(f"{name}: offsets table is corrupt")
        self.name = name
        self.count = int(count)
        self._offsets = offsets.astype(np.int64)
        self.token_dtype = dtype_of_flags(flags, name)
        self.token_start = int(offsets[0]) if count else size
        self.tokens = 0
        if self.token_dtype is not None and count:
            width = self.token_dtype.itemsize
            if np.any(self._offsets % width != self._offsets[0] % width):
                raise TruncatedChunkError(
                    f"{name}: a document of this token chunk is not a whole number of "
                    f"{self.token_dtype.name} tokens"
                )
            self.tokens = (size - self.token_start) // width

    def __len__(self) -> int:
        return self.count

    def span(self, i: int) -> tuple[int, int]:
        """``(start, end)`` byte offsets of item ``i``."""
        return int(self._offsets[i]), int(self._offsets[i + 1])
