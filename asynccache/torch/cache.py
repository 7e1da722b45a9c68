"""``Cache``: write items once as chunk files, then read them back by key."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

from ..config import Settings, as_size
from ..errors import AsyncCacheError, ConfigError, ObjectNotFoundError, TruncatedChunkError
from ..format import INDEX_NAME, Index
from ..read.reader import Reader
from ..read.source import DatasetSource, is_remote, local_dir
from ..write.writelock import WriteLock, check_token
from ..write.writer import ChunkWriter, merge_dir, remove_partial
from . import distributed


class CacheNotFilledError(AsyncCacheError, LookupError):
    """The cache has no ``index.json`` yet, so it can't be read."""


class Cache:
    """A dataset stored as ``chunk-{writer}-{n}.bin`` files plus ``index.json``.

    Writing: ``cache.write(item)`` numbers items itself (0, 1, 2, ... in call order) and
    returns the key; ``cache[i] = item`` chooses the key, in any order. Items are nested
    dicts, lists, tuples, namedtuples and dataclasses of tensors, arrays, numbers,
    strings, bytes and images; namedtuples and dataclasses come back as the same types
    (see docs/format.md). Each process (and each DataLoader worker)
    writes its own chunk files. ``CacheDataLoader`` finishes the writers and merges
    their indexes at the end of the first epoch; used alone, call :meth:`done`.
    ``filled`` is true once a complete ``index.json`` exists.

    One job writes into a directory at a time: a standalone write holds the directory's
    write lock from its first item until :meth:`done` (``CacheDataLoader`` holds it for
    its writing epoch); another job gets ``WriteConflictError``. A write that starts
    where an earlier one crashed removes that write's chunk files first, so old and new
    chunks never mix.

    Opening a filled local dataset checks every chunk's size against ``index.json``: a
    chunk truncated or replaced after it was written (a power loss before it reached the
    disk, a copy gone wrong) raises ``TruncatedChunkError`` naming it, at once, rather
    than part-way through an epoch. It is not rewritten silently: the source data may be
    gone, and other processes may be reading; delete the directory to write it again.

    Reading: ``cache[i]`` returns exactly what was written at ``i``; numpy and torch
    leaves are zero-copy views of the chunk's memory mapping.

    A remote dataset (``s3://``, ``http(s)://``) is read through the chunk downloader into
    ``cache_dir``; write datasets locally and publish them with ``asynccache.upload``.

    Args:
        input_dir: the dataset directory, or the URL of a written dataset.
        chunk_size: at most this many items per chunk.
        chunk_bytes: at most this many bytes per chunk (default 64 MiB when neither is set).
        allow_pickle: store (and read back) leaves of other types with pickle. Only for
            data you trust: unpickling can run arbitrary code.
        verify: check each chunk's checksum when it is first opened in this process
            (downloaded chunks are always verified before they are cached).
        compression: ``"zstd"`` stores large leaf buffers compressed when that saves space
            (needs the ``compression`` extra; such leaves are copies, not views, on read).
        cache_dir: where remote chunks are cached (default ``ASYNCCACHE_CACHE_DIR``).
        storage_options: endpoint, credentials and TLS options for remote storage.
        max_cache_bytes: the local cache budget (default ``ASYNCCACHE_MAX_CACHE_BYTES``).
    """

    def __init__(
        self,
        input_dir: str | os.PathLike[str],
        chunk_size: int | None = None,
        chunk_bytes: int | str | None = None,
        *,
        allow_pickle: bool = False,
        verify: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        max_cache_bytes: int | str | None = None,
        compression: str | None = None,
    ) -> None:
        url = os.fspath(input_dir)
        self.url = url
        self.remote = is_remote(url)
        self.input_dir = url if self.remote else local_dir(url)
        self.cache_dir = cache_dir
        self.storage_options = storage_options
        self.max_cache_bytes = (
            None if max_cache_bytes is None else as_size(max_cache_bytes, "max_cache_bytes")
        )
        self.compression = compression
        self.chunk_size = chunk_size
        self.chunk_bytes = None if chunk_bytes is None else as_size(chunk_bytes, "chunk_bytes")
        self.allow_pickle = allow_pickle
        self.verify = verify
        self._writer: ChunkWriter | None = None
        self._reader: Reader | None = None
        # Set by CacheDataLoader for one write pass; see begin_write.
        self._writer_id: int | None = None
        self._token: str | None = None
        self._accept = True
        self._lock: WriteLock | None = None  # held by a standalone write, until done()
        self._next_key = 0  # the key write() gives next: after every key written so far

    # -- state ---------------------------------------------------------------------
    @property
    def index_path(self) -> str:
        return os.path.join(self.input_dir, INDEX_NAME)

    @property
    def filled(self) -> bool:
        """True once a complete ``index.json`` exists."""
        if self._reader is not None:
            return True
        if not self.remote:
            return os.path.exists(self.index_path)
        try:
            self._open()
        except ObjectNotFoundError:
            return False
        return True

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
                source = DatasetSource(
                    self.url,
                    cache_dir=self.cache_dir,
                    storage_options=self.storage_options,
                    settings=Settings.from_env(max_cache_bytes=self.max_cache_bytes),
                )
            except FileNotFoundError:
                if self.remote:
                    raise
                raise CacheNotFilledError(
                    f"{self.input_dir}: no {INDEX_NAME} yet; write the dataset first"
                ) from None
            if not source.remote:
                _check_sizes(self.input_dir, source.index)
            self._reader = Reader(
                source.index,
                source.acquire,
                release=source.release,
                verify=self.verify and not source.remote,
                allow_pickle=self.allow_pickle,
                max_open=16 if not source.remote else 4,
            )
            self.source = source
        return self._reader

    # -- writing -------------------------------------------------------------------
    def __setitem__(self, key: int, item: Any) -> None:
        if self.remote:
            raise ConfigError(
                f"{self.url}: a remote Cache is read-only; write the dataset to "
                "a local directory, then publish it with asynccache.upload()"
            )
        if not self._accept:
            return  # a repeat the loader pads with; its first copy is written elsewhere
        if self._writer is None:
            self._start_standalone()
        assert self._writer is not None
        self._writer.add(key, item)
        self._next_key = max(self._next_key, int(key) + 1)

    def write(self, item: Any) -> int:
        """Write ``item`` under the next key (0 for the first, then one after the highest
        key written by this process so far) and return that key. Finish with :meth:`done`.

        Raises:
            SerializationError: ``item`` holds a leaf that can't be stored (the message
                names the field of a namedtuple or dataclass it sits in).
        """
        key = self._next_key
        self[key] = item
        return key

    def _start_standalone(self) -> None:
        """Begin a write not driven by ``CacheDataLoader``: lock, refuse filled, clean up."""
        writer = self._writer_id
        if writer is None:
            writer = distributed.current().writer_id
        token = secrets.token_hex(8)
        lock = WriteLock.acquire(self.input_dir, token)  # WriteConflictError: another job
        try:
            if os.path.exists(self.index_path):
                raise ConfigError(
                    f"{self.input_dir} is already filled ({INDEX_NAME} exists); delete the "
                    "directory to write the dataset again"
                )
            remove_partial(self.input_dir, token)  # what a crashed earlier write left
            self.begin_write(writer, self._token)
        except BaseException:
            lock.release()
            raise
        self._lock = lock

    def begin_write(self, writer_id: int, token: str | None) -> None:
        """Write this process's items as writer ``writer_id`` of job ``token`` (a loader's
        write pass; ``token``: the job's claim on the directory, checked now)."""
        if token is not None:
            check_token(self.input_dir, token)  # WriteConflictError: another job's dir now
        self._writer_id, self._token = writer_id, token
        self._writer = ChunkWriter(
            self.input_dir,
            writer_id,
            chunk_bytes=self.chunk_bytes,
            chunk_size=self.chunk_size,
            token=token,
            allow_pickle=self.allow_pickle,
            compression=self.compression,
        )

    def finish_write(self) -> None:
        """Flush this writer's last chunk and publish its ``{writer}.index.json``."""
        if self._writer is not None:
            self._writer.finish()
            self._writer = None

    def abandon_write(self) -> None:
        """Drop this process's writer without publishing its index (an abandoned pass)."""
        self._writer = None

    @contextlib.contextmanager
    def accepting(self, accept: bool) -> Iterator[None]:
        """Within: ``cache[key] = item`` writes only when ``accept`` (a dataset that fills
        its own cache in ``__getitem__`` writes each item once, at its first read)."""
        before, self._accept = self._accept, accept
        try:
            yield
        finally:
            self._accept = before

    def done(self) -> Index:
        """Finish writing from a single process: publish the last chunk and ``index.json``."""
        if self._writer is None:
            self._start_standalone()
        assert self._writer is not None
        writer = self._writer.writer
        try:
            self.finish_write()
            index = merge_dir(self.input_dir, [writer], token=None)
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        self._reader = None
        return index

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None  # the lock stays with the process that took it
        if state["_writer"] is not None:
            raise ConfigError(
                f"{self.input_dir}: a Cache can't be copied to another process "
                "while it has unflushed writes"
            )
        return state

    def __repr__(self) -> str:
        return f"Cache({self.input_dir!r}, filled={self.filled})"


def _check_sizes(directory: str, index: Index) -> None:
    """Every chunk present must have the size ``index.json`` records (one stat each).

    A missing chunk is reported when it is read (``ObjectNotFoundError``).

    Raises:
        TruncatedChunkError: names the chunk and says what to do.
    """
    for entry in index.chunks:
        path = os.path.join(directory, entry.filename)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            continue
        if size != entry.bytes:
            raise TruncatedChunkError(
                f"{path}: {size} bytes, but {INDEX_NAME} records {entry.bytes}: the chunk was "
                "truncated or replaced after the dataset was written (a crash before it "
                f"reached the disk, or another write); delete {directory} and write the "
                "dataset again"
            )
