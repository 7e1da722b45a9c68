"""Writing a dataset: items -> ``chunk-{writer}-{n}.bin`` + ``{writer}.index.json`` -> merge.

Each writer (one per DataLoader worker per rank) owns its file names, so writers never
share a file. A chunk is published by atomic rename once complete; ``{writer}.index.json``
is written when the writer finishes; ``index.json`` is written last by :func:`merge_dir`
and is the commit point: a reader that sees it sees every chunk it names.

Durability: every chunk and writer index is fsynced before its rename; the merge fsyncs
the directory (so those names are on disk), then writes ``index.json`` (fsync, rename)
and fsyncs the directory again. So after a power loss an ``index.json`` on disk never
names a chunk that is missing or truncated.

One job writes into a directory at a time (:mod:`asynccache.write.writelock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .._version import __version__
from ..cache import indexfile
from ..cache.fsutil import atomic_write, fsync_dir
from ..errors import BadIndexError, CacheError, ConfigError, WriteConflictError
from ..format import (
    INDEX_NAME,
    ChunkEntry,
    ChunkView,
    Index,
    build,
    encode,
    encoded_size,
    merge,
    runs,
)
from ..format.images import open_file_bytes
from ..format.index import format_checksum, new_hasher
from ..format.items import compressor
from ..format.tokens import encode_tokens, flags_for, token_dtype
from .writelock import is_held, read_holder

DEFAULT_CHUNK_BYTES = 64 << 20
# A merge waits for the other writers only while they make progress (a new or larger
# file in the directory): this long without any change means they are gone.
MERGE_STALL_S = 600.0
_POLL_S = (0.02, 1.0)  # first and longest pause between looks; doubles in between
_WRITTEN = re.compile(r"chunk-\d+-\d+\.bin|\d+\.index\.json")
#: A merged index with more key runs than this per chunk is rewritten in key order.
COMPACT_RUNS_PER_CHUNK = 2
#: The writer number of chunks rewritten in key order (no DataLoader writer gets it).
SORTED_WRITER = 999_999_999


#: An image file larger than this is not read back to keep its bytes (encoded instead).
MAX_KEPT_IMAGE_BYTES = 256 << 20


def original_image_bytes(img: Any) -> bytes | None:
    """The bytes a ``PIL`` image was opened from: its open file object's, else its file
    name's (an image whose pixels were loaded, which closed the file). The format layer
    keeps them only if they decode to exactly this image (``format/images.py``), so a file
    changed since it was opened, or an image edited since, is encoded instead."""
    data = open_file_bytes(img)
    if data is not None:
        return data
    name = getattr(img, "filename", None)
    if not isinstance(name, str) or not name:
        return None
    try:
        with open(name, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_KEPT_IMAGE_BYTES:
                return None
            return f.read()
    except OSError:
        return None


def writer_index_name(writer: int) -> str:
    return f"{writer}.index.json"


class ChunkWriter:
    """Buffers items and writes them as chunks of at most ``chunk_bytes`` / ``chunk_size``.

    A single item larger than ``chunk_bytes`` gets a chunk of its own. Keys may arrive in
    any order; each chunk records the runs of keys it holds.

    With ``tokens`` (a dtype such as ``"uint16"``), every item is a document: a 1-D
    integer array stored as raw tokens of that dtype (a token chunk, docs/tokens.md), and
    each chunk's token count goes into the index.
    """

    def __init__(
        self,
        directory: str,
        writer: int = 0,
        *,
        chunk_bytes: int | None = None,
        chunk_size: int | None = None,
        token: str | None = None,
        allow_pickle: bool = False,
        compression: str | None = None,
        tokens: str | None = None,
    ) -> None:
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if chunk_size is not None and chunk_size <= 0:
            raise ConfigError(f"chunk_size must be > 0, got {chunk_size}")
        if chunk_bytes is None and chunk_size is None:
            chunk_bytes = DEFAULT_CHUNK_BYTES
        self.directory = directory
        self.writer = writer
        self.chunk_bytes = chunk_bytes
        self.chunk_size = chunk_size
        self.token = token
        self.allow_pickle = allow_pickle
        self.compression = compression
        if compression is not None:
            compressor(compression)  # fail now, not at the first item
        self.token_dtype = None if tokens is None else token_dtype(tokens)
        if self.token_dtype is not None and compression is not None:
            raise ConfigError("tokens= and compression= can't be combined (tokens are mapped)")
        self._tokens = 0
        self._keys: list[int] = []
        self._items: list[list[memoryview | bytes]] = []
        self._bytes = 0
        self._entries: list[ChunkEntry] = []
        self.items_written = 0
        os.makedirs(directory, exist_ok=True)

    @property
    def config(self) -> dict[str, Any]:
        cfg = {
            "chunk_bytes": self.chunk_bytes,
            "chunk_size": self.chunk_size,
            "compression": self.compression,
            "writer": f"asynccache {__version__}",
        }
        if self.token_dtype is not None:
            cfg["token_dtype"] = self.token_dtype.name
        return cfg

    def add(self, key: int, item: Any) -> None:
        """Store ``item`` under ``key`` (a non-negative int)."""
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            raise ConfigError(f"cache keys must be non-negative integers, got {key!r}")
        if self.token_dtype is not None:
            pieces = encode_tokens(item, self.token_dtype)
        else:
            pieces = encode(
                item,
                allow_pickle=self.allow_pickle,
                compression=self.compression,
                image_bytes=original_image_bytes,
            )
        size = encoded_size(pieces) + 8
        full_by_bytes = self.chunk_bytes is not None and self._bytes + size > self.chunk_bytes
        full_by_count = self.chunk_size is not None and len(self._items) >= self.chunk_size
        if self._items and (full_by_bytes or full_by_count):
            self.flush()
        self._keys.append(key)
        self._items.append(pieces)
        self._bytes += size
        self._tokens += encoded_size(pieces)
        self.items_written += 1

    def flush(self) -> None:
        """Publish the buffered items as one chunk (no-op when empty)."""
        if not self._items:
            return
        name = f"chunk-{self.writer}-{len(self._entries)}.bin"
        hasher = new_hasher()

        dt = self.token_dtype
        flags = 0 if dt is None else flags_for(dt)
        chunk = build(self._items, flags)

        def pieces() -> Iterable[bytes | memoryview]:
            for p in chunk:
                hasher.update(p)
                yield p

        size = atomic_write(os.path.join(self.directory, name), pieces(), fsync=True)
        tokens = None if dt is None else self._tokens // dt.itemsize
        self._entries.append(
            ChunkEntry(
                name,
                len(self._items),
                size,
                format_checksum(hasher),
                runs(self._keys),
                tokens,
                chunk.head,
            )
        )
        self._keys, self._items, self._bytes, self._tokens = [], [], 0, 0

    def finish(self) -> Index:
        """Flush and write ``{writer}.index.json``; returns this writer's index."""
        self.flush()
        idx = Index(tuple(self._entries), self.config, self.writer, self.token)
        atomic_write(
            os.path.join(self.directory, writer_index_name(self.writer)),
            [idx.to_json().encode()],
            fsync=True,
        )
        return idx


def progress_marker(directory: str) -> frozenset[tuple[str, int]]:
    """Names and sizes in ``directory``: it changes whenever any writer makes progress."""
    out = set()
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
        for entry in it:
            with contextlib.suppress(FileNotFoundError):
                out.add((entry.name, entry.stat().st_size))
    return frozenset(out)


class ProgressWait:
    """Polls with growing pauses; gives up once ``directory`` stops changing for ``stall_s``.

    Bounded by progress, not by a fixed total: a slow but live write pass may take
    hours; a dead one is noticed ``stall_s`` after its last file appeared.
    """

    def __init__(self, directory: str, stall_s: float) -> None:
        self.directory, self.stall_s = directory, stall_s
        self._marker = progress_marker(directory)
        self._last = time.monotonic()
        self._pause = _POLL_S[0]

    def stalled(self) -> bool:
        """Pause, then True when nothing changed in the last ``stall_s`` seconds."""
        time.sleep(self._pause)
        self._pause = min(self._pause * 2, _POLL_S[1])
        marker = progress_marker(self.directory)
        now = time.monotonic()
        if marker != self._marker:
            self._marker, self._last, self._pause = marker, now, _POLL_S[0]
        return now - self._last > self.stall_s


def read_index(path: str) -> Index:
    """Read and validate an index file (either version). Raises BadIndexError naming
    the file at fault."""
    try:
        return indexfile.read_path(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CacheError(f"cannot read {path}: {exc.strerror}") from exc


def merge_dir(
    directory: str,
    writers: Iterable[int],
    *,
    token: str | None = None,
    timeout_s: float = MERGE_STALL_S,
    config: Mapping[str, Any] | None = None,
    renumber: bool = False,
) -> Index:
    """Wait for every writer's ``{w}.index.json`` of this ``token``, then write ``index.json``.

    The wait is bounded by progress: it fails once nothing in the directory changed for
    ``timeout_s`` seconds while writers are still missing.

    The merged ``config`` is the writers' config updated with ``config``.

    With ``renumber``, each writer's keys are its own ``0 .. n-1`` (it could not know
    global positions, e.g. when it read an iterable); they are shifted so that writer 0's
    items come first, then writer 1's, and so on.

    Raises:
        CacheError: writers made no progress for ``timeout_s`` (names which).
        BadIndexError: the writers' keys overlap or leave gaps.
    """
    pending = set(writers)
    parts: list[Index] = []
    wait = ProgressWait(directory, timeout_s)
    while pending:
        for w in sorted(pending):
            path = os.path.join(directory, writer_index_name(w))
            with contextlib.suppress(FileNotFoundError):
                part = read_index(path)
                if token is None or part.token == token:
                    parts.append(part)
                    pending.discard(w)
        if pending and wait.stalled():
            raise CacheError(
                f"{directory}: writers {sorted(pending)} have not finished and nothing was "
                f"written for {timeout_s:.0f}s; they are gone (a crashed worker or rank)"
            )
    if renumber:
        parts = _renumbered(parts)
    cfg = {**(parts[0].config if parts else {}), **(config or {})}
    try:
        idx = merge(parts, cfg)
    except BadIndexError as exc:
        raise BadIndexError(f"{directory}: cannot merge writer indexes: {exc}") from exc
    if sum(len(c.keys) for c in idx.chunks) > COMPACT_RUNS_PER_CHUNK * max(1, len(idx.chunks)):
        idx = compact_dir(directory, idx)
    fsync_dir(directory)  # the chunk and writer-index names, before the commit names them
    # Version 2: the column sidecar, then index.json naming it (the commit).
    return indexfile.write_dir(directory, idx, fsync=True)


def compact_dir(directory: str, index: Index) -> Index:
    """Rewrite ``index``'s chunks in key order: the result has one key run per chunk.

    Items written in a shuffled order (a shuffled writing epoch, ``cache[i] = x`` in any
    order) leave each chunk holding scattered keys, one ``[key, 1]`` run each: ~31 bytes
    of ``index.json`` per item. Rewriting keeps ``index.json`` O(chunks) whatever the
    order, at the cost of copying the items once (raw bytes, no decoding).

    New chunks are ``chunk-{SORTED_WRITER}-{n}.bin`` of the same ``chunk_bytes`` /
    ``chunk_size``; each is fsynced and renamed into place, then the old chunks are
    deleted (the writers' own indexes stay, as the record of the pass; only ``index.json``
    is read by readers). The caller writes ``index.json`` after this returns: a
    crash before then leaves no ``index.json``, so the write pass starts over
    (:func:`remove_partial` clears every chunk of either name).
    """
    chunk_bytes = index.config.get("chunk_bytes")
    chunk_size = index.config.get("chunk_size")
    if chunk_bytes is None and chunk_size is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES
    maps: list[mmap.mmap | bytes] = []
    views: list[ChunkView] = []
    try:
        for c in index.chunks:
            path = os.path.join(directory, c.filename)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b"")
            views.append(ChunkView(maps[-1], path))
        n = index.total_items
        chunk_of, pos_of = index.locate_many(np.arange(n, dtype=np.int64))
        entries: list[ChunkEntry] = []
        batch: list[list[memoryview | bytes]] = []
        batch_bytes = 0
        # A token dataset stays one: the same flags, and each chunk's token count.
        dt = views[0].token_dtype if views else None
        flags = 0 if dt is None else flags_for(dt)

        def flush(first: int) -> None:
            nonlocal batch, batch_bytes
            if not batch:
                return
            name = f"chunk-{SORTED_WRITER}-{len(entries)}.bin"
            hasher = new_hasher()
            chunk = build(batch, flags)  # the items' checksums are computed again here

            def pieces() -> Iterable[bytes | memoryview]:
                for p in chunk:
                    hasher.update(p)
                    yield p

            size = atomic_write(os.path.join(directory, name), pieces(), fsync=True)
            tokens = None if dt is None else sum(len(p[0]) for p in batch) // dt.itemsize
            entries.append(
                ChunkEntry(
                    name,
                    len(batch),
                    size,
                    format_checksum(hasher),
                    ((first, len(batch)),),
                    tokens,
                    chunk.head,
                )
            )
            batch, batch_bytes = [], 0

        first = 0
        for key, (ci, pos) in enumerate(zip(chunk_of.tolist(), pos_of.tolist(), strict=True)):
            a, b = views[ci].span(pos)
            full_bytes = chunk_bytes is not None and batch_bytes + (b - a) + 8 > chunk_bytes
            full_count = chunk_size is not None and len(batch) >= chunk_size
            if batch and (full_bytes or full_count):
                flush(first)
                first = key
            batch.append([memoryview(maps[ci])[a:b]])
            batch_bytes += b - a + 8
        flush(first)
    finally:
        for m in maps:
            if isinstance(m, mmap.mmap):
                with contextlib.suppress(BufferError):
                    m.close()
    fsync_dir(directory)  # the new names, before the old ones go
    for name in [c.filename for c in index.chunks]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    return Index(tuple(entries), index.config)


def _renumbered(parts: list[Index]) -> list[Index]:
    out, offset = [], 0
    for part in sorted(parts, key=lambda p: p.writer or 0):
        chunks = tuple(
            dataclasses.replace(c, keys=tuple((a + offset, n) for a, n in c.keys))
            for c in part.chunks
        )
        out.append(dataclasses.replace(part, chunks=chunks))
        offset += part.total_items
    return out


def remove_partial(directory: str, token: str | None = None) -> None:
    """Delete the files of an unfinished write (no ``index.json``): chunks and writer indexes.

    Only names this writer produces (``chunk-<n>-<n>.bin``, ``<n>.index.json``) are
    touched, so other files in the directory are safe. Call it holding the directory's
    write lock for pass ``token``.

    Raises:
        WriteConflictError: another pass holds the write lock: its files are not ours
            to delete.
    """
    if os.path.exists(os.path.join(directory, INDEX_NAME)):
        return
    holder = read_holder(directory)
    theirs = holder is not None and holder.get("token") != token
    if theirs and (token is not None or is_held(directory)):
        raise WriteConflictError(
            f"{directory}: another job holds the write lock; its files are left alone"
        )
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if _WRITTEN.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
