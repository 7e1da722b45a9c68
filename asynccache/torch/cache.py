"""``Cache``: write items once as chunk files, then read them back by key."""

from __future__ import annotations

import os
from typing import Any

from ..errors import AsyncCacheError, ConfigError
from ..format import INDEX_NAME, Index
from ..reader import Reader
from ..writer import ChunkWriter, merge_dir, read_index
from . import distributed


class CacheNotFilledError(AsyncCacheError, LookupError):
    """The cache has no ``index.json`` yet, so it can't be read."""


class Cache:
    """A dataset stored as ``chunk-{writer}-{n}.bin`` files plus ``index.json``.

    Writing: ``cache[i] = item`` in any order; each process (and each DataLoader worker)
    writes its own chunk files. ``CacheDataLoader`` finishes the writers and merges
    their indexes at the end of the first epoch; used alone, call :meth:`done`.
    ``filled`` is true once a complete ``index.json`` exists.

    Reading: ``cache[i]`` returns exactly what was written at ``i``; numpy and torch
    leaves are zero-copy views of the chunk's memory mapping.

    Args:
        input_dir: the dataset directory.
        chunk_size: at most this many items per chunk.
        chunk_bytes: at most this many bytes per chunk (default 64 MiB when neither is set).
        allow_pickle: store (and read back) leaves of other types with pickle. Only for
            data you trust: unpickling can run arbitrary code.
        verify: check each chunk's checksum when it is first opened in this process.
    """

    def __init__(
        self,
        input_dir: str | os.PathLike[str],
        chunk_size: int | None = None,
        chunk_bytes: int | None = None,
        *,
        allow_pickle: bool = False,
        verify: bool = True,
    ) -> None:
        self.input_dir = os.fspath(input_dir)
        if "://" in self.input_dir and not self.input_dir.startswith("file://"):
            raise ConfigError(f"{self.input_dir}: only local directories are supported here")
        self.input_dir = self.input_dir.removeprefix("file://")
        self.chunk_size = chunk_size
        self.chunk_bytes = chunk_bytes
        self.allow_pickle = allow_pickle
        self.verify = verify
        self._writer: ChunkWriter | None = None
        self._reader: Reader | None = None
        # Set by CacheDataLoader for one write pass; see _begin_write.
        self._writer_id: int | None = None
        self._token: str | None = None
        self._accept = True

    # -- state ---------------------------------------------------------------------
    @property
    def index_path(self) -> str:
        return os.path.join(self.input_dir, INDEX_NAME)

    @property
    def filled(self) -> bool:
        """True once a complete ``index.json`` exists."""
        return self._reader is not None or os.path.exists(self.index_path)

    @property
    def index(self) -> Index:
        return self._open().index

    def __len__(self) -> int:
        """Items in the dataset once filled; before that, items this process has written."""
        if self.filled:
            return len(self._open())
        return self._writer.items_written if self._writer else 0

    # -- reading -------------------------------------------------------------------
    def __getitem__(self, key: int) -> Any:
        return self._open()[int(key)]

    def _open(self) -> Reader:
        if self._reader is None:
            try:
                index = read_index(self.index_path)
            except FileNotFoundError:
                raise CacheNotFilledError(
                    f"{self.input_dir}: no {INDEX_NAME} yet; write the dataset first"
                ) from None
            directory = self.input_dir
            self._reader = Reader(
                index,
                lambda _ci, entry: os.path.join(directory, entry.filename),
                verify=self.verify,
                allow_pickle=self.allow_pickle,
            )
        return self._reader

    # -- writing -------------------------------------------------------------------
    def __setitem__(self, key: int, item: Any) -> None:
        if not self._accept:
            return  # a repeat the loader pads with; its first copy is written elsewhere
        if self._writer is None:
            writer = self._writer_id
            if writer is None:
                writer = distributed.current().writer_id
            self._writer = ChunkWriter(
                self.input_dir,
                writer,
                chunk_bytes=self.chunk_bytes,
                chunk_size=self.chunk_size,
                token=self._token,
                allow_pickle=self.allow_pickle,
            )
        self._writer.add(key, item)

    def _begin_write(self, writer_id: int, token: str | None) -> None:
        self._writer_id, self._token = writer_id, token
        self._writer = ChunkWriter(
            self.input_dir,
            writer_id,
            chunk_bytes=self.chunk_bytes,
            chunk_size=self.chunk_size,
            token=token,
            allow_pickle=self.allow_pickle,
        )

    def _finish_write(self) -> None:
        """Flush this writer's last chunk and publish its ``{writer}.index.json``."""
        if self._writer is not None:
            self._writer.finish()
            self._writer = None

    def done(self) -> Index:
        """Finish writing from a single process: publish the last chunk and ``index.json``."""
        writer = self._writer.writer if self._writer else 0
        if self._writer is None:
            self._begin_write(0, None)
        self._finish_write()
        index = merge_dir(self.input_dir, [writer], token=None)
        self._reader = None
        return index

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if state["_writer"] is not None:
            raise ConfigError(
                f"{self.input_dir}: a Cache can't be copied to another process "
                "while it has unflushed writes"
            )
        state["_reader"] = None
        return state

    def __repr__(self) -> str:
        return f"Cache({self.input_dir!r}, filled={self.filled})"
