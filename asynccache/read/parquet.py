"""A prefix of Parquet files read without conversion: each row group is a unit.

``ParquetSource(url)`` lists the ``.parquet`` files under ``url`` (a directory,
``s3://``, ``gs://``, ``az://``, ``http(s)`` with listing, or ``hf://datasets/org/name``),
and builds its index from their footers: each file's last bytes fetched with range GETs,
many at once. The footers are cached, keyed by the listing (each file's key, size and ETag,
or a local file's modification time and size): in this node's cache directory, and beside
the data (``_asynccache-footers-<tag>.bin``) where the store takes writes. A later open
lists the prefix (one request per thousand files) and reuses the footers whose listing
matches; any change builds them again.

A unit is one row group, of the columns read (``columns=``): only the pages of those
columns are fetched, into the cache, under the same budget as chunks. A worker decodes it
with pyarrow (:class:`ParquetUnit`) into items (a dict per row: numpy scalars for numbers,
``str``, ``bytes``, numpy arrays for lists of numbers, Python values otherwise) or, on the
batch path, columns.

Trust (docs/sources.md, "Parquet"): row groups are not checksummed (that would mean reading
every byte to build the index). A unit's bytes are its file's at the offsets its footer
gives, checked by size; and each range is handed over only after a ``HEAD`` made after it
arrived found the file as listed (size and ETag; a local file: size and modification time,
before and after the read). A file that changes under a running job fails with
:class:`DatasetRewrittenError` naming it; rows of two versions are never mixed. A Hub
dataset is read at one pinned commit, whose files can't change.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..bridge import get_loop_thread
from ..cache.fsutil import atomic_write
from ..config import Settings
from ..errors import (
    ConfigError,
    CorruptIndexError,
    DataError,
    ObjectNotFoundError,
    StorageError,
    TransientError,
)
from ..format import Index
from ..format.parquet import (
    TAIL,
    FileInfo,
    Footers,
    footer_length,
    pyarrow_modules,
    row_groups,
)
from ..storage.base import Storage
from .listing import NoFilesError, list_local, list_remote
from .source import local_dir
from .source_units import Decode, UnitSource
from .unit_storage import Piece, Unit

__all__ = ["PARQUET_GLOB", "ParquetSource", "ParquetUnit", "is_parquet_url"]

log = logging.getLogger(__name__)

PARQUET_GLOB = "**/*.parquet"
_TAIL_GUESS = 64 << 10  # the first footer read: most footers fit in it
_ATTEMPTS = 4


def is_parquet_url(url: str) -> bool:
    """A URL of one ``.parquet`` file's folder: read as Parquet without looking for an
    index. (An ``hf://`` repository may hold a written dataset's ``index.json``: it is
    looked for first, as under any other URL.)"""
    return url.rstrip("/").endswith(".parquet")


class ParquetSource(UnitSource):
    """The row groups of the Parquet files under ``url`` matching ``files`` (default
    ``**/*.parquet``), read for ``columns`` (None: all). See the module docstring.

    Raises (when made):
        ConfigError: pyarrow is missing (says how to install it), no file matches, or a
            column is not in the files.
        CorruptFooterError, BadMagicError: a file's footer can't be read (names it).
        SchemaMismatchError: the files' schemas differ (names both files).
        ObjectNotFoundError: a listed file is gone before its footer was read (names it).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        columns: Sequence[str] | None = None,
        files: str | None = None,
        refresh: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        settings: Settings | None = None,
    ) -> None:
        pyarrow_modules()  # fail now, saying how to install it
        if columns is not None and (isinstance(columns, str) or not columns):
            raise ConfigError(f"columns= must be a non-empty list of names, got {columns!r}")
        self.columns = None if columns is None else tuple(columns)
        self.pattern = files or PARQUET_GLOB
        self.refresh = refresh
        super().__init__(
            url, cache_dir=cache_dir, storage_options=storage_options, settings=settings
        )

    # -- the index -----------------------------------------------------------------
    def _build(self) -> tuple[Index, Mapping[str, Unit]]:
        footers = self._footers()
        groups = row_groups(footers, self.columns, self.url)
        self.groups = _Groups(
            groups.columns,
            groups.file_of,
            groups.group_of,
            groups.segments,
            groups.files,
            footers.footers,
        )
        base = self._where_base()
        units = {}
        for c in range(groups.index.num_chunks):
            info = groups.files[groups.file_of[c]]
            units[groups.index.filename(c)] = Unit(
                tuple(Piece(info.key, s, n, info.size, info.etag) for s, n in groups.segments[c]),
                f"{base}/{info.key} (row group {groups.group_of[c]})",
            )
        if groups.index.total_items == 0:
            raise ConfigError(f"{self.url}: the Parquet files hold no rows")
        return groups.index, units

    def _where_base(self) -> str:
        return self.url.rstrip("/")

    def _footers(self) -> Footers:
        """The footers of the files listed now: from a cache whose listing matches, or
        fetched (and cached)."""
        if not self.remote:
            root = local_dir(self.url)
            listing = list_local(root, self.pattern)
            self._check_listing(listing)
            return self._cached_or(listing, lambda: _local_footers(root, listing, self.url))
        return get_loop_thread().call(self._remote_footers(), self._bound())

    def _bound(self) -> float:
        st = self.settings
        return st.timeout_s * (_ATTEMPTS + 20) + st.backoff_max_s * _ATTEMPTS

    def _check_listing(self, listing: Sequence[FileInfo]) -> None:
        if not listing:
            raise NoFilesError(
                f"{self.url}: no file matches {self.pattern!r} (a Parquet source reads "
                "the .parquet files under its URL; files= chooses others)"
            )

    async def _remote_footers(self) -> Footers:
        storage = self.inner_storage()
        timeout = self.settings.timeout_s * 20
        listing = await list_remote(storage, self.pattern, timeout)
        if self.url.startswith("hf://") and listing:
            # Pin the commit (the first answer's), then list at it: every later read
            # (other processes too, through the pinned URL) sees these very files.
            await storage.head(listing[0].key)
            pinned = getattr(storage, "pinned_url", None)
            if pinned:
                self._open_url = pinned
            listing = await list_remote(storage, self.pattern, timeout)
        self._check_listing(listing)
        local = self._local_cache_path()
        if not self.refresh:
            got = await asyncio.to_thread(_load_footers, local, listing)
            if got is not None:
                return got
            beside = await self._beside(storage, listing)
            if beside is not None:
                await asyncio.to_thread(_save_footers, local, beside)
                return beside
        footers = await _fetch_footers(storage, listing, self.url, self.settings)
        await asyncio.to_thread(_save_footers, local, footers)
        await self._write_beside(storage, footers)
        return footers

    def _cached_or(self, listing: list[FileInfo], build: Any) -> Footers:
        local = self._local_cache_path()
        if not self.refresh:
            got = _load_footers(local, listing)
            if got is not None:
                return got
            beside = os.path.join(local_dir(self.url), self._beside_name())
            got = _load_footers(beside, listing)
            if got is not None:
                _save_footers(local, got)
                return got
        footers: Footers = build()
        _save_footers(local, footers)
        try:  # beside the data, where the directory takes writes
            atomic_write(
                os.path.join(local_dir(self.url), self._beside_name()), [footers.to_bytes()]
            )
        except Exception as exc:
            log.debug("%s: footers not written beside the data: %r", self.url, exc)
        return footers

    def _beside_name(self) -> str:
        tag = hashlib.sha256(self.pattern.encode()).hexdigest()[:12]
        return f"_asynccache-footers-{tag}.bin"

    def _local_cache_path(self) -> str:
        digest = hashlib.sha256(f"{self.url}\n{self.pattern}".encode()).hexdigest()[:32]
        return os.path.join(self.settings.cache_dir, ".sources", f"{digest}.footers")

    async def _beside(self, storage: Storage, listing: list[FileInfo]) -> Footers | None:
        name = self._beside_name()
        try:
            data = await asyncio.wait_for(storage.read(name), self.settings.timeout_s)
            got = Footers.from_bytes(data, storage.object_url(name))
        except (StorageError, CorruptIndexError, asyncio.TimeoutError) as exc:
            log.debug("%s: no usable footers beside the data: %r", self.url, exc)
            return None
        return got if got.matches(listing) else None

    async def _write_beside(self, storage: Storage, footers: Footers) -> None:
        if self.url.startswith("hf://"):
            return  # read-only
        fd, tmp = tempfile.mkstemp(prefix=".asynccache-footers-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(footers.to_bytes())
            await asyncio.wait_for(
                storage.upload(tmp, self._beside_name()), self.settings.timeout_s * 4
            )
        except Exception as exc:  # a read-only store: the local cache serves this node
            log.debug("%s: footers not written beside the data: %r", self.url, exc)
        finally:
            os.unlink(tmp)

    # -- decoding ------------------------------------------------------------------
    def decoder(self) -> Decode:
        return _Decoder(self.groups, self._where_base())


class _Groups:
    """What a worker needs to decode units: per unit its file, row group and segments;
    per file its size, footer bytes (parsed once per process) and name."""

    def __init__(
        self,
        columns: tuple[str, ...],
        file_of: tuple[int, ...],
        group_of: tuple[int, ...],
        segments: tuple[tuple[tuple[int, int], ...], ...],
        files: tuple[FileInfo, ...],
        footers: tuple[bytes, ...],
    ) -> None:
        self.columns, self.file_of, self.group_of = columns, file_of, group_of
        self.segments, self.files, self.footers = segments, files, footers


class _Decoder:
    """Turns a unit's bytes into a :class:`ParquetUnit` (picklable; parses each file's
    footer once per process)."""

    def __init__(self, groups: _Groups, base: str) -> None:
        self.groups, self.base = groups, base
        self._meta: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"groups": self.groups, "base": self.base, "_meta": {}}

    def __call__(self, ci: int, data: bytes) -> ParquetUnit:
        from ..format.parquet import metadata_of

        g = self.groups
        fi = g.file_of[ci]
        info = g.files[fi]
        where = f"{self.base}/{info.key} (row group {g.group_of[ci]})"
        md = self._meta.get(fi)
        if md is None:
            md = self._meta[fi] = metadata_of(g.footers[fi], f"{self.base}/{info.key}")
        pa, pq = pyarrow_modules()
        view = _Segmented(data, g.segments[ci], info.size, where)
        try:
            pf = pq.ParquetFile(pa.PythonFile(view, mode="r"), metadata=md, pre_buffer=False)
            table = pf.read_row_group(g.group_of[ci], columns=list(g.columns))
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{where}: pages do not decode ({type(exc).__name__}: {exc})") from exc
        if table.num_rows != md.row_group(g.group_of[ci]).num_rows:
            raise DataError(f"{where}: decoded {table.num_rows} rows, the footer says more")
        return ParquetUnit(table)


class _Segmented(io.RawIOBase):
    """A file of ``size`` bytes of which only ``segments`` are here (``data``, back to
    back): what pyarrow reads a row group from. A read outside them is refused."""

    def __init__(
        self, data: bytes, segments: Sequence[tuple[int, int]], size: int, where: str
    ) -> None:
        super().__init__()
        self.data, self.size, self.where, self.pos = memoryview(data), size, where, 0
        self.starts, self.at = [], []
        off = 0
        for s, n in segments:
            self.starts.append((s, s + n))
            self.at.append(off)
            off += n

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self.size - self.pos
        a, b = self.pos, min(self.pos + n, self.size)
        if a >= b:
            return b""
        for (s, e), off in zip(self.starts, self.at, strict=True):
            if s <= a and b <= e:
                self.pos = b
                return bytes(self.data[off + a - s : off + b - s])
        raise DataError(f"{self.where}: pyarrow asked for bytes [{a}, {b}) outside the unit")

    def readinto(self, buf: Any) -> int:
        got = self.read(len(buf))
        memoryview(buf)[: len(got)] = got
        return len(got)


class ParquetUnit:
    """One row group decoded (a ``pyarrow.Table``): rows as dicts, or columns."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.names = list(table.column_names)
        self._values: dict[str, Any] = {}

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def _column(self, name: str) -> Any:
        got = self._values.get(name)
        if got is None:
            got = self._values[name] = _values(self.table.column(name))
        return got

    def item(self, pos: int) -> dict[str, Any]:
        return {name: self._column(name)[pos] for name in self.names}

    def columns(self, positions: np.ndarray) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        for name in self.names:
            col = _batch_column(self.table.column(name), positions, self._column(name))
            if col is None:
                return None
            out[name] = col
        return out


def _values(col: Any) -> Any:
    """A column as item values by position (see the module docstring): arrays are
    writable copies (a tensor made from one must not share arrow's read-only memory)."""
    pa, _ = pyarrow_modules()
    t = col.type
    if col.null_count == 0:
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            return np.array(col.to_numpy())  # (numpy scalars come out of it)
        if _numeric_lists(pa, t):
            arr = col.combine_chunks()
            flat = np.array(arr.flatten().to_numpy(zero_copy_only=False))
            if pa.types.is_fixed_size_list(t):
                offsets = np.arange(len(arr) + 1, dtype=np.int64) * t.list_size
            else:
                offsets = arr.offsets.to_numpy().astype(np.int64)
                offsets -= offsets[0]
            return _Rows(flat, offsets)
    return col.to_pylist()


def _numeric_lists(pa: Any, t: Any) -> bool:
    return bool(
        (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
        and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type))
    )


class _Rows:
    """Rows of a column of lists of numbers: row ``i`` is a view of one flat array."""

    __slots__ = ("flat", "offsets")

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat, self.offsets = flat, offsets

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def stacked(self, positions: np.ndarray) -> np.ndarray | None:
        """Rows ``positions`` as one 2-D array, when they are all of one length."""
        lengths = self.offsets[positions + 1] - self.offsets[positions]
        if len(positions) == 0 or (lengths != lengths[0]).any():
            return None
        idx = self.offsets[positions][:, None] + np.arange(int(lengths[0]))[None, :]
        return self.flat[idx]


def _batch_column(col: Any, positions: np.ndarray, values: Any) -> Any:
    """Column ``col`` at ``positions`` as collating its items makes it, or None."""
    pa, _ = pyarrow_modules()
    t = col.type
    if isinstance(values, np.ndarray):
        return values[positions]
    if isinstance(values, _Rows):
        return values.stacked(positions)
    if col.null_count:
        return None
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    ):
        return [values[i] for i in positions.tolist()]
    return None


# -- fetching footers ------------------------------------------------------------------
async def _fetch_footers(
    storage: Storage, listing: list[FileInfo], url: str, settings: Settings
) -> Footers:
    """Each file's footer, by range GETs of its end, ``max_concurrency`` at a time."""
    sem = asyncio.Semaphore(max(1, settings.max_concurrency))

    async def one(info: FileInfo) -> bytes:
        async with sem:
            return await _footer(storage, info, settings)

    got = await asyncio.gather(*(one(f) for f in listing))
    return Footers(url, tuple(listing), tuple(got))


async def _footer(storage: Storage, info: FileInfo, settings: Settings) -> bytes:
    where = storage.object_url(info.key)
    if info.size < 12:
        footer_length(b"", info.size, where)  # raises, naming the file
    take = min(info.size, _TAIL_GUESS)
    tail = await _get(storage, info.key, info.size - take, info.size, settings)
    n = footer_length(tail[-TAIL:], info.size, where)
    if n + TAIL > len(tail):
        tail = await _get(storage, info.key, info.size - n - TAIL, info.size, settings)
    return tail[-(n + TAIL) :]


async def _get(storage: Storage, key: str, start: int, end: int, settings: Settings) -> bytes:
    where = storage.object_url(key)
    for attempt in range(_ATTEMPTS):
        try:
            body = await asyncio.wait_for(storage.read(key, start, end), settings.timeout_s)
            if len(body) == end - start:
                return body
            raise TransientError(f"{where}: short answer ({len(body)} of {end - start} bytes)")
        except ObjectNotFoundError as exc:
            raise ObjectNotFoundError(
                f"{where}: missing (it was listed a moment ago): {exc}", url=where
            ) from exc
        except (TransientError, asyncio.TimeoutError):
            if attempt == _ATTEMPTS - 1:
                raise
            await asyncio.sleep(min(settings.backoff_max_s, 0.2 * 2**attempt))
    raise AssertionError("unreachable")


def _local_footers(root: str, listing: list[FileInfo], url: str) -> Footers:
    out = []
    for info in listing:
        path = os.path.join(root, info.key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 12:
                    footer_length(b"", size, path)
                f.seek(size - TAIL)
                n = footer_length(f.read(TAIL), size, path)
                f.seek(size - n - TAIL)
                out.append(f.read(n + TAIL))
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(
                f"{path}: missing (it was listed a moment ago)", url=path
            ) from exc
    return Footers(url, tuple(listing), tuple(out))


def _load_footers(path: str, listing: list[FileInfo]) -> Footers | None:
    try:
        with open(path, "rb") as f:
            got = Footers.from_bytes(f.read(), path)
    except (OSError, CorruptIndexError):
        return None
    return got if got.matches(listing) else None


def _save_footers(path: str, footers: Footers) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, [footers.to_bytes()])
    except Exception as exc:  # a cache that can't be written is rebuilt next time
        log.debug("footers not cached at %s: %r", path, exc)
