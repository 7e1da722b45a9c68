"""The chunk file: many items, one self-describing binary file.

Byte layout (little-endian)::

    offset        size        field
    0             8           magic  b"ACCHUNK\\n"
    8             4           u32 format version (2; 1 for token chunks and older chunks)
    12            4           u32 flags (0: items; bit 0 and a dtype code: tokens, see tokens.py)
    16            8           u64 item count N
    24            8*(N+1)     u64 offsets: item i is bytes [off[i], off[i+1]); off[N] == file size
    32+8N         8*N         version 2 only: u64 xxh3_64 of each item's bytes [off[i], off[i+1])
    ...                       zero padding to 64
    off[0]                    item 0 (see items.py), each item starts on a 64-byte boundary

The *header* is the bytes before the first item, ``[0, items_start(N, version))``. The
index records the ``xxh3_64`` of a version-2 chunk's header (its ``head``), so a reader
that fetched the header alone, by range, verifies it against the index, and then each
item it fetches by range against the item's checksum in that header, before using any
of those bytes.

In a token chunk the items are raw little-endian tokens packed with no padding, so the
tokens of the whole chunk are the contiguous bytes ``[off[0], off[N])``. Token chunks are
written as version 1: they are never read by range, and a checksum per document would
cost 8 bytes for every (often short) document.

A chunk is valid only if its size equals ``off[N]``: a truncated file is always detected.
Pure module: it builds bytes and parses buffers, it does no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import xxhash

from ..errors import BadMagicError, TruncatedChunkError, UnsupportedVersionError
from .items import align, encoded_size
from .tokens import dtype_of_flags

MAGIC = b"ACCHUNK\n"
#: The version written for chunks of items: the header holds a checksum per item.
VERSION = 2
#: The version without item checksums: token chunks, and chunks of older releases.
VERSION_PLAIN = 1
VERSIONS = (VERSION_PLAIN, VERSION)
_HEAD = struct.Struct("<8sIIQ")
HEADER_BYTES = _HEAD.size


def items_start(count: int, version: int = VERSION) -> int:
    """Offset of the first item in a chunk of ``count`` items of format ``version``: the
    length of its header."""
    table = 8 * (count + 1) + (8 * count if version >= 2 else 0)
    return align(HEADER_BYTES + table)


def _table_end(count: int, version: int) -> int:
    """The end of the offsets table (and of the item checksums in version 2)."""
    return HEADER_BYTES + 8 * (count + 1) + (8 * count if version >= 2 else 0)


class Built:
    """A chunk file as pieces to write in order (iterate it): its header, then the pieces
    of each item.

    ``head`` is the ``xxh3_64`` of the header as the index records it
    (``"xxh3_64:<16 hex>"``), or None for a version-1 (token) chunk, which has none.
    """

    __slots__ = ("head", "header", "items")

    def __init__(self, header: bytes, items: list[list[memoryview | bytes]], head: str | None):
        self.header, self.items, self.head = header, items, head

    def __iter__(self) -> Iterator[memoryview | bytes]:
        yield self.header
        for pieces in self.items:
            yield from pieces


def build(encoded_items: Iterable[list[memoryview | bytes]], flags: int = 0) -> Built:
    """The pieces of a chunk file holding ``encoded_items`` (from ``items.encode``, or from
    ``tokens.encode_tokens`` with ``flags=tokens.flags_for(dtype)``), and its header's
    checksum. Items are hashed here, once, for the header's item checksums."""
    items = list(encoded_items)
    version = VERSION if flags == 0 else VERSION_PLAIN
    n = len(items)
    offsets = np.empty(n + 1, dtype="<u8")
    pos = items_start(n, version)
    for i, pieces in enumerate(items):
        offsets[i] = pos
        pos += encoded_size(pieces)
    offsets[n] = pos
    parts = [_HEAD.pack(MAGIC, version, flags, n), offsets.tobytes()]
    if version >= 2:
        sums = np.empty(n, dtype="<u8")
        for i, pieces in enumerate(items):
            h = xxhash.xxh3_64()
            for p in pieces:
                h.update(p)
            sums[i] = h.intdigest()
        parts.append(sums.tobytes())
    used = sum(len(p) for p in parts)
    parts.append(b"\0" * (items_start(n, version) - used))
    header = b"".join(parts)
    head = f"xxh3_64:{xxhash.xxh3_64_hexdigest(header)}" if version >= 2 else None
    return Built(header, items, head)


def parse_header(buf: Any, count: int, size: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The item offsets and item checksums of a version-2 chunk of items, parsed from its
    header alone (a range read of ``[0, items_start(count))``, before the chunk is here).

    ``count`` and ``size`` are the index's: the header must agree with them. The caller
    has verified the header's bytes against the index's ``head`` checksum; these checks
    catch an index and chunk that disagree all the same.

    Raises:
        BadMagicError, UnsupportedVersionError, TruncatedChunkError: naming ``name``;
            also for a token chunk or a version-1 chunk (no item checksums).
    """
    offsets, sums = _parse(buf, count, size, name)
    if sums is None:
        raise UnsupportedVersionError(f"{name}: a version-1 chunk carries no item checksums")
    return offsets, sums


def header_offsets(buf: Any, count: int, size: int, name: str) -> np.ndarray:
    """The item offsets of a chunk of items (either version), parsed from its header
    alone; see :func:`parse_header`."""
    return _parse(buf, count, size, name)[0]


def _parse(buf: Any, count: int, size: int, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    if len(buf) < HEADER_BYTES:
        raise TruncatedChunkError(f"{name}: {len(buf)} bytes can't hold a chunk header")
    magic, version, flags, n = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadMagicError(f"{name}: not an asynccache chunk (bad magic bytes {magic!r})")
    if version not in VERSIONS or flags != 0:
        raise UnsupportedVersionError(f"{name}: version {version} flags {flags:#x}: not items")
    if len(buf) < items_start(count, version):
        raise TruncatedChunkError(
            f"{name}: {len(buf)} bytes can't hold the header of {count} items"
        )
    offsets = np.frombuffer(buf, dtype="<u8", count=count + 1, offset=HEADER_BYTES)
    offsets = offsets.astype(np.int64)
    if (
        n != count
        or int(offsets[-1]) != size
        or (count and int(offsets[0]) < _table_end(count, version))
        or np.any(np.diff(offsets) < 0)
    ):
        raise TruncatedChunkError(f"{name}: header does not match the index ({count} items)")
    sums = None
    if version >= 2:
        at = HEADER_BYTES + 8 * (count + 1)
        sums = np.frombuffer(buf, dtype="<u8", count=count, offset=at).astype(np.uint64)
    return offsets, sums


class ChunkView:
    """Parsed header of a chunk held in a buffer (an mmap); item ``i`` spans ``span(i)``.

    Reads chunk versions 1 and 2 (``version``); holds no view of ``buf`` (its mapping can
    be closed). ``token_dtype`` is the dtype of a token chunk (None for a chunk of items);
    its tokens are ``tokens`` elements from byte ``token_start``.

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
        if version not in VERSIONS:
            raise UnsupportedVersionError(
                f"{name}: chunk format version {version} is not supported (this release "
                f"reads versions {VERSION_PLAIN} and {VERSION}); upgrade asynccache or "
                "rewrite the dataset"
            )
        table_end = _table_end(count, version)
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
        self.version = int(version)
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

    def item_checksums(self, buf: Any) -> np.ndarray | None:
        """The item checksums of this version-2 chunk held in ``buf`` (a read-only view of
        it), or None for version 1."""
        if self.version < 2:
            return None
        at = HEADER_BYTES + 8 * (self.count + 1)
        return np.frombuffer(buf, dtype="<u8", count=self.count, offset=at)
