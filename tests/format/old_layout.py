"""Datasets in the layout of the previous format: chunk version 1 (no item checksums in
the header) and an index without header checksums, as releases before chunk version 2
wrote them. Written here byte by byte from docs/format.md, not by the library's writer,
so the tests keep meaning "what an older release left in a bucket"."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asynccache.cache import indexfile
from asynccache.format import ChunkEntry, Index, checksum, encode

MAGIC = b"ACCHUNK\n"


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


def chunk_v1(items: list[Any]) -> bytes:
    """A version-1 chunk file holding ``items``: the 24-byte header, the offsets table,
    zero padding to 64, the encoded items."""
    bodies = [b"".join(bytes(p) for p in encode(x)) for x in items]
    n = len(bodies)
    pos = _pad64(24 + 8 * (n + 1))
    offsets = []
    for b in bodies:
        offsets.append(pos)
        pos += len(b)
    offsets.append(pos)
    head = struct.pack("<8sIIQ", MAGIC, 1, 0, n) + struct.pack(f"<{n + 1}Q", *offsets)
    head += b"\0" * (_pad64(len(head)) - len(head))
    return head + b"".join(bodies)


def write_v1_dataset(
    directory: Path, n: int, per_chunk: int, item: Callable[[int], Any], *, columns: bool
) -> Path:
    """Items ``item(0..n-1)`` in version-1 chunks of ``per_chunk``; ``index.json`` of
    version 2 (a column sidecar, without a ``head`` column) when ``columns``, else of
    version 1 (its chunk entries without ``head``)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for c, first in enumerate(range(0, n, per_chunk)):
        keys = range(first, min(n, first + per_chunk))
        data = chunk_v1([item(i) for i in keys])
        name = f"chunk-0-{c}.bin"
        (directory / name).write_bytes(data)
        entries.append(
            ChunkEntry(name, len(keys), len(data), checksum(data), ((first, len(keys)),))
        )
    idx = Index(tuple(entries), {"chunk_size": per_chunk})
    if columns:
        indexfile.write_dir(os.fspath(directory), idx, fsync=False)
    else:
        (directory / "index.json").write_text(idx.to_json())
    return directory
