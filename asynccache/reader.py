"""Reading items: key -> chunk -> mmap -> item, zero-copy for numpy and torch leaves.

The reader asks a ``resolve`` callable for the local path of a chunk; for a local
dataset that is the file in place, for a remote one the downloader fetches it first.
Chunks are mapped copy-on-write (``ACCESS_COPY``): leaves are writable views that share
pages with the file until written, and writing to them never changes the file.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import forksafe
from .errors import ChecksumMismatchError, DataError, ObjectNotFoundError, TruncatedChunkError
from .format import ChunkEntry, ChunkView, Index, checksum, decode

Resolve = Callable[[int, ChunkEntry], str]
Release = Callable[[int], None]


class _Mapped:
    __slots__ = ("mm", "path", "view")

    def __init__(self, mm: Any, view: ChunkView, path: str) -> None:
        self.mm, self.view, self.path = mm, view, path


def map_chunk(path: str, entry: ChunkEntry, *, verify: bool) -> tuple[Any, ChunkView]:
    """Map ``path`` and check it against its index ``entry`` (size; checksum if ``verify``).

    Raises:
        TruncatedChunkError, ChecksumMismatchError, BadMagicError, UnsupportedVersionError:
            naming the file.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; the mapping outlives it
    except FileNotFoundError as exc:
        raise ObjectNotFoundError(f"{path}: chunk named in the index is missing", url=path) from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != entry.bytes:
            raise TruncatedChunkError(
                f"{path}: file has {size} bytes but the index says {entry.bytes}"
            )
        mm: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    if verify:
        got = checksum(mm)
        if got != entry.checksum:
            raise ChecksumMismatchError(
                f"{path}: checksum {got} does not match the index ({entry.checksum})"
            )
    view = ChunkView(mm, path)
    if len(view) != entry.items:
        raise TruncatedChunkError(f"{path}: holds {len(view)} items, the index says {entry.items}")
    if entry.tokens is not None and view.token_dtype is not None and view.tokens != entry.tokens:
        raise TruncatedChunkError(
            f"{path}: holds {view.tokens} tokens, the index says {entry.tokens}"
        )
    return mm, view


class Reader:
    """Random access to the items of one dataset.

    Thread-safe. Keeps up to ``max_open`` chunks mapped and calls ``release(ci)`` for each
    ``resolve`` once it drops that mapping; an item handed out keeps its own mapping alive
    for as long as it lives, so dropping a mapping never invalidates an item.

    Fork: a forked child starts with a new mutex and an empty table of open chunks. The
    inherited mappings were resolved (pinned) by the parent, so the child never releases
    them; items it already holds stay valid. Which chunks were verified is kept (the files
    are the same).
    """

    def __init__(
        self,
        index: Index,
        resolve: Resolve,
        *,
        verify: bool = True,
        allow_pickle: bool = False,
        max_open: int = 16,
        release: Release | None = None,
    ) -> None:
        self.index = index
        self._resolve = resolve
        self._release = release
        self._verify = verify
        self._allow_pickle = allow_pickle
        self._max_open = max_open
        self._open: collections.OrderedDict[int, _Mapped] = collections.OrderedDict()
        self._verified: set[int] = set()
        self._lock = threading.Lock()
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the mutex at the fork: it would never be released.
        self._lock = threading.Lock()
        # The parent's pins: releasing them here would unpin what this process never pinned.
        self._open = collections.OrderedDict()

    def __len__(self) -> int:
        return self.index.total_items

    def __getitem__(self, key: int) -> Any:
        ci, pos = self.index.locate(key)
        return self.read(ci, pos)

    def read(self, chunk: int, pos: int) -> Any:
        """Item ``pos`` of chunk number ``chunk``."""
        m = self._chunk(chunk)
        start, end = m.view.span(pos)
        dt = m.view.token_dtype
        if dt is not None:  # a token chunk: the document is a view of the mapping
            return np.frombuffer(m.mm, dt, (end - start) // dt.itemsize, start)
        return decode(
            m.mm, start, end, where=f"{m.path} item {pos}", allow_pickle=self._allow_pickle
        )

    def chunk_tokens(self, chunk: int) -> np.ndarray:
        """Every token of token chunk number ``chunk``, as one view of its mapping.

        Raises:
            DataError: the chunk holds items, not tokens.
        """
        m = self._chunk(chunk)
        dt = m.view.token_dtype
        if dt is None:
            raise DataError(f"{m.path}: holds items, not tokens (written without tokens=)")
        if not m.view.tokens:
            return np.empty(0, dt)
        return np.frombuffer(m.mm, dt, m.view.tokens, m.view.token_start)

    def _chunk(self, ci: int) -> _Mapped:
        with self._lock:
            m = self._open.get(ci)
            if m is not None:
                self._open.move_to_end(ci)
                return m
        entry = self.index.chunks[ci]
        path = self._resolve(ci, entry)
        try:
            mm, view = map_chunk(path, entry, verify=self._verify and ci not in self._verified)
        except BaseException:
            self._released(ci)
            raise
        m = _Mapped(mm, view, path)
        dropped = []
        with self._lock:
            self._verified.add(ci)
            if ci in self._open:  # another thread mapped it meanwhile: keep one
                dropped.append(ci)
                m = self._open[ci]
            else:
                self._open[ci] = m
            while len(self._open) > self._max_open:
                dropped.append(self._open.popitem(last=False)[0])
        for d in dropped:
            self._released(d)
        return m

    def _released(self, ci: int) -> None:
        if self._release is not None:
            self._release(ci)

    def release(self, ci: int) -> None:
        """Drop this reader's mapping of chunk ``ci`` (items already returned stay valid)."""
        with self._lock:
            held = self._open.pop(ci, None)
        if held is not None:
            self._released(ci)

    def close(self) -> None:
        """Drop every mapping (items already returned stay valid)."""
        with self._lock:
            dropped = list(self._open)
            self._open.clear()
        for ci in dropped:
            self._released(ci)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = collections.OrderedDict()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        forksafe.register(self)
