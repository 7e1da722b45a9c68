"""Sources other than written datasets: their units, cached, decoded into items.

A Parquet prefix (:mod:`.parquet`) or a folder of files (:mod:`.files`) is read as a
sequence of *units* (a row group, a pack of small files), each a chunk of an
:class:`~asynccache.format.Index` built from the source itself. Above this module
everything is as for a written dataset: the order, the rank x worker split, resume, the
node's read plan, the budget and eviction see chunks (units) and their byte sizes; the
downloader fetches a unit into the cache like a chunk (:mod:`.unit_storage` maps it to
the ranges of the files it covers).

Here:

* :class:`UnitSource` is the :class:`~.source.DatasetSource` of such a source: its index
  is built (or loaded from its cache) by the subclass, its storage presents units, and
  :meth:`UnitSource.unit_bytes` gives a unit's bytes (from the cache for a remote source,
  read in place from the files for a local one, checked against the listing);
* :class:`SourceReader` is the reader: a unit's bytes decoded once into a
  :class:`UnitData`, kept for ``max_open`` units, items taken from it by position;
* :class:`SourceUnits` is the :class:`~.units.UnitReader` the epoch loop asks, with a
  columnar batch where the source has one (:meth:`SourceUnits.columns_batch`).

Invariant: a unit's cache pin is held only while its bytes are read; its decoded form
lives in the reader (at most ``max_open`` units, least recently used first out).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from ..bridge import forksafe
from ..download.downloader import ChunkSpec
from ..errors import DataError, DatasetRewrittenError, ObjectNotFoundError
from ..format import ChunkEntry, Index
from ..storage import open_storage
from .source import DatasetSource, local_dir
from .unit_storage import Unit, UnitStorage
from .units import UnitReader

__all__ = ["SourceReader", "SourceUnits", "UnitData", "UnitSource"]


class UnitData(Protocol):
    """One unit decoded: its items by position, and (optionally) a columnar batch."""

    def __len__(self) -> int: ...

    def item(self, pos: int) -> Any: ...

    def columns(self, positions: np.ndarray) -> dict[str, Any] | None:
        """The items at ``positions`` as columns (name -> numpy array or list), or None
        when some column has no columnar form equal to collating the items."""
        ...


Decode = Callable[[int, bytes], UnitData]


class UnitSource(DatasetSource):
    """A source whose units are built from its files (see the module docstring).

    Subclasses set their options, then call ``super().__init__``, and implement
    :meth:`_build` (the index and the unit table) and :meth:`decoder`.
    """

    #: Check each file read with a HEAD after its bytes arrived (see :mod:`.unit_storage`).
    verify_after = True

    units: dict[str, Unit]

    def _read_index(self) -> Index:
        self.units = {}
        self._open_url = self.url
        try:
            index, units = self._build()
        except BaseException:
            self.close()
            raise
        self.units.update(units)
        return index

    def _build(self) -> tuple[Index, Mapping[str, Unit]]:
        raise NotImplementedError

    def decoder(self) -> Decode:
        """The function that turns a unit's bytes into its items."""
        raise NotImplementedError

    # -- storage -------------------------------------------------------------------
    def _connect(self) -> Any:
        from ..bridge import get_loop_thread
        from ..download.connection import Connection

        with self._mu:
            conn = self._slot.conn
            if conn is None or conn.pid != os.getpid() or conn.closed:
                inner = open_storage(
                    self._open_url, self.settings, self.storage_options, self._aws_env
                )
                # A Hub dataset is read at one pinned commit: its files can't change.
                pinned = self._open_url.startswith("hf://")
                storage = UnitStorage(
                    inner,
                    self.units,
                    verify_after=self.verify_after and not pinned,
                    check_etag=not pinned,
                    concurrency=self.settings.max_concurrency,
                )
                conn = self._slot.conn = Connection(storage, get_loop_thread())
            return conn

    def inner_storage(self) -> Any:
        """This process's storage of the source's files (not of its units)."""
        return self._connect().storage.inner

    def spec(self, ci: int) -> ChunkSpec:
        e = self.index.chunks[ci]
        return ChunkSpec(e.filename, e.bytes, None)  # verified by size, and by its files

    @property
    def first_read_bytes(self) -> int:
        return 0  # a unit is decoded whole: nothing is read by item ranges

    def chunk_url(self, ci: int) -> str:
        return self.units[self.index.filename(ci)].where

    def acquire(self, ci: int, entry: ChunkEntry | None = None) -> str:
        if not self.remote:
            unit = self.units[self.index.filename(ci)]
            return os.path.join(local_dir(self.url), unit.pieces[0].key)
        return super().acquire(ci, entry)

    def release(self, ci: int) -> None:
        if self.remote:
            super().release(ci)

    # -- bytes of a unit -------------------------------------------------------------
    def unit_bytes(self, ci: int) -> bytes:
        """The bytes of unit ``ci``: from this node's cache (downloaded if needed) for a
        remote source; read from its files for a local one, each file checked against
        the listing before and after (a file changed meanwhile raises
        :class:`DatasetRewrittenError` naming it)."""
        unit = self.units[self.index.filename(ci)]
        if self.remote:
            path = self.acquire(ci)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            finally:
                self.release(ci)
            if len(data) != unit.size:
                raise DataError(
                    f"{unit.where}: {len(data)} bytes cached, the index says {unit.size}"
                )
            return data
        return read_local(local_dir(self.url), unit)


def local_etag(st: os.stat_result) -> str:
    """What stands for an ETag of a local file: its modification time and size."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


def read_local(root: str, unit: Unit) -> bytes:
    """The bytes of ``unit``'s pieces, read from the files under ``root``."""
    out = bytearray()
    fds: dict[str, int] = {}
    try:
        for p in unit.pieces:
            fd = fds.get(p.key)
            path = os.path.join(root, p.key)
            if fd is None:
                try:
                    fd = fds[p.key] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError as exc:
                    raise ObjectNotFoundError(
                        f"{path}: missing (it was listed when the source was indexed)",
                        url=path,
                    ) from exc
                _check_local(fd, path, p.size, p.etag)
            got = os.pread(fd, p.length, p.start)
            if len(got) != p.length:
                raise DatasetRewrittenError(
                    f"{path}: {len(got)} bytes at {p.start}, the index says {p.length}: "
                    "changed since the source was indexed; open the dataset again"
                )
            out += got
        for key, fd in fds.items():  # after the reads: a change during them is seen
            p = next(q for q in unit.pieces if q.key == key)
            _check_local(fd, os.path.join(root, key), p.size, p.etag)
    finally:
        for fd in fds.values():
            os.close(fd)
    return bytes(out)


def _check_local(fd: int, path: str, size: int, etag: str) -> None:
    st = os.fstat(fd)
    now = local_etag(st)
    if st.st_size != size or (etag and now != etag):
        raise DatasetRewrittenError(
            f"{path}: changed since the source was indexed ({st.st_size} bytes, modified "
            f"{st.st_mtime_ns}; listed with {size} bytes); no row of it is read from two "
            "versions: open the dataset again to read the new version"
        )


class SourceReader:
    """Items of a :class:`UnitSource`, by (unit, position). Thread-safe.

    Each unit is read (:meth:`UnitSource.unit_bytes`) and decoded once, and kept decoded
    for as long as it is among the ``max_open`` most recently used. Fork: a child starts
    with a new mutex and no decoded units.
    """

    def __init__(self, index: Index, source: UnitSource, max_open: int = 2) -> None:
        self.index, self.source = index, source
        self._decode = source.decoder()
        self._max_open = max(1, max_open)
        self._open: collections.OrderedDict[int, UnitData] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._early: dict[int, Any] = {}  # nothing is read by range here
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._open = collections.OrderedDict()

    def unit(self, ci: int) -> UnitData:
        """Unit ``ci`` decoded (read and decoded now if it is not open)."""
        with self._lock:
            got = self._open.get(ci)
            if got is not None:
                self._open.move_to_end(ci)
                return got
        data = self._decode(ci, self.source.unit_bytes(ci))
        with self._lock:
            self._open[ci] = data
            while len(self._open) > self._max_open:
                self._open.popitem(last=False)
        return data

    def read(self, chunk: int, pos: int) -> Any:
        return self.unit(chunk).item(pos)

    def __getitem__(self, key: int) -> Any:
        ci, pos = self.index.locate(key)
        return self.read(ci, pos)

    def __len__(self) -> int:
        return self.index.total_items

    def expect(self, chunks: np.ndarray, positions: np.ndarray, *, whole: bool = False) -> None:
        self.source.send_hint()  # the epoch's prefetch, held back until the first read

    def fetches_no_chunk(
        self,
        chunks: np.ndarray,
        positions: np.ndarray,
        *,
        small: bool = False,
        whole: bool = False,
    ) -> bool:
        return all(self.source.landed(c) for c in set(chunks.tolist()))

    def set_range_budget(self, nbytes: int) -> None:
        """Nothing is read by range from these sources."""

    def release(self, ci: int) -> None:
        with self._lock:
            self._open.pop(ci, None)

    def close(self) -> None:
        with self._lock:
            self._open.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = collections.OrderedDict()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        forksafe.register(self)


class SourceUnits(UnitReader):
    """The :class:`UnitReader` of a :class:`UnitSource`: items one by one, and whole
    batches as columns where the source's units have them."""

    reader: Any

    def __init__(self, index: Index, reader: SourceReader, source: UnitSource, max_forms: int):
        super().__init__(index, reader, source, None, max_forms)  # type: ignore[arg-type]

    def read_units(self, keys: np.ndarray) -> tuple[np.ndarray, Iterator[Any]]:
        chunks, positions = self.index.locate_many(keys)
        self.reader.expect(chunks, positions)
        pairs = zip(chunks.tolist(), positions.tolist(), strict=True)
        return chunks, (self.reader.read(ci, pos) for ci, pos in pairs)

    def located(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """As for chunks, but always "read otherwise": no mapped chunk holds these items
        in the chunk format, so a batch is never assembled from one."""
        chunks, positions = self.index.locate_many(keys)
        self.reader.expect(chunks, positions, whole=True)
        return chunks, positions, True

    def chunk_forms(self, chunk: int) -> Any:
        raise DataError(f"{self.source.url}: a unit of this source is not a chunk of items")

    def columns_batch(self, keys: np.ndarray) -> dict[str, Any] | None:
        """The batch of units ``keys`` as columns (name -> numpy array or list), equal to
        collating the items one by one; None when a column has no such form (the caller
        collates the items)."""
        chunks, positions = self.index.locate_many(keys)
        self.reader.expect(chunks, positions)
        order = list(dict.fromkeys(chunks.tolist()))
        parts: list[tuple[np.ndarray, dict[str, Any]]] = []
        for c in order:
            sel = np.nonzero(chunks == c)[0]
            cols = self.reader.unit(c).columns(positions[sel])
            if cols is None:
                return None
            parts.append((sel, cols))
        if len(parts) == 1:
            return parts[0][1]
        return _join(parts, len(keys))


def _join(parts: list[tuple[np.ndarray, dict[str, Any]]], n: int) -> dict[str, Any] | None:
    """Columns of several units put back in the batch's order."""
    names = list(parts[0][1])
    out: dict[str, Any] = {}
    where = np.concatenate([sel for sel, _ in parts])
    back = np.empty(n, dtype=np.int64)
    back[where] = np.arange(n)
    for name in names:
        vals = [cols[name] for _, cols in parts]
        if all(isinstance(v, np.ndarray) for v in vals):
            if len({(v.dtype, v.shape[1:]) for v in vals}) != 1:
                return None
            out[name] = np.concatenate(vals)[back]
        elif all(isinstance(v, list) for v in vals):
            flat = [x for v in vals for x in v]
            out[name] = [flat[i] for i in back.tolist()]
        else:
            return None
    return out
