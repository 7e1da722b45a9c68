"""Parquet files as units: row groups described as chunks of an :class:`~.index.Index`.

Pure: footers (bytes) in, descriptions out; no I/O. pyarrow is optional
(``pip install 'asynccache[parquet]'``); every function that needs it says so with a
:class:`ConfigError`.

A Parquet file ends with its footer (a thrift ``FileMetaData``), its length (``u32``) and
the magic ``PAR1``. The footer gives each row group's rows and, per column, the byte range
of its pages (``[dictionary_page_offset or data_page_offset, + total_compressed_size)``).
A *unit* is one row group read for a selection of columns: the ranges of those columns'
pages, merged where they touch. It is a chunk of the index: items are its rows, bytes the
sum of its ranges, keys consecutive over the files in order. Its name in the cache,
``chunk-pq-<file>-<version>-<row group>-<columns>.bin`` (a chunk name: the cache counts and
evicts it), changes when the file's size or ETag does, or the selection, so a cached unit is
never taken for another version's.

:class:`Footers` is what an index of a Parquet prefix is built from and cached as: each
file's key, size, ETag and footer bytes, sealed with an ``xxh3_64`` of its body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgpack
import xxhash

from ..errors import (
    BadMagicError,
    ConfigError,
    CorruptFooterError,
    CorruptIndexError,
    SchemaMismatchError,
)
from .index import ChunkEntry, Index

__all__ = [
    "MAGIC",
    "TAIL",
    "FileInfo",
    "Footers",
    "RowGroups",
    "footer_length",
    "metadata_of",
    "pyarrow_modules",
    "row_groups",
]

MAGIC = b"PAR1"
#: The bytes that end a Parquet file after its footer: ``u32`` length, ``PAR1``.
TAIL = 8
_FOOTERS_FORMAT = "asynccache-parquet-footers"
_FOOTERS_VERSION = 1


def pyarrow_modules() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``.

    Raises:
        ConfigError: pyarrow is not installed (says how to install it).
    """
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ConfigError(
            "reading Parquet needs pyarrow, an optional extra: pip install 'asynccache[parquet]'"
        ) from exc
    return pyarrow, pyarrow.parquet


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One file as listed: its key under the dataset root, size, and ETag (or, for a local
    file, its modification time and size); the ETag may be empty where none is known."""

    key: str
    size: int
    etag: str

    @property
    def version(self) -> str:
        """16 hex digits that change with the file's size or ETag (or key)."""
        h = xxhash.xxh3_64(f"{self.key}\0{self.size}\0{self.etag}".encode())
        return h.hexdigest()


def footer_length(tail: bytes | memoryview, size: int, where: str) -> int:
    """The footer length a file's last :data:`TAIL` bytes give.

    Raises:
        BadMagicError: the file does not end with ``PAR1`` (not Parquet, or truncated).
        CorruptFooterError: the length does not fit in the file.
    """
    tail = bytes(tail)
    if size < 12 or len(tail) != TAIL or tail[4:] != MAGIC:
        raise BadMagicError(
            f"{where}: not a Parquet file: its last bytes are {tail[-4:]!r}, not {MAGIC!r} "
            f"({size} bytes)"
        )
    n = int.from_bytes(tail[:4], "little")
    if n <= 0 or n + TAIL + 4 > size:
        raise CorruptFooterError(
            f"{where}: corrupt Parquet footer: its length field says {n} bytes, in a file of "
            f"{size} bytes"
        )
    return n


def metadata_of(footer: bytes, where: str) -> Any:
    """The ``pyarrow.parquet.FileMetaData`` of ``footer`` (the footer's bytes, followed by
    its length and ``PAR1``).

    Raises:
        CorruptFooterError: pyarrow can't read it (names ``where``).
    """
    pa, pq = pyarrow_modules()
    try:
        return pq.read_metadata(pa.BufferReader(footer))
    except Exception as exc:
        raise CorruptFooterError(f"{where}: corrupt Parquet footer ({exc})") from exc


@dataclasses.dataclass(frozen=True)
class Footers:
    """The files of a Parquet prefix as listed, each with its footer bytes (ending with the
    length and ``PAR1``): what the index is made from, and what is cached."""

    url: str
    files: tuple[FileInfo, ...]
    footers: tuple[bytes, ...]

    def matches(self, listing: Sequence[FileInfo]) -> bool:
        """The same files, sizes and ETags as ``listing`` (in order)."""
        return tuple(listing) == self.files

    def to_bytes(self) -> bytes:
        body = msgpack.packb(
            {
                "format": _FOOTERS_FORMAT,
                "version": _FOOTERS_VERSION,
                "url": self.url,
                "files": [[f.key, f.size, f.etag] for f in self.files],
                "footers": list(self.footers),
            },
            use_bin_type=True,
        )
        return xxhash.xxh3_64(body).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Footers:
        """Raises:
        CorruptIndexError: damaged (its checksum) or not such a file."""
        body = data[8:]
        if len(data) < 8 or xxhash.xxh3_64(body).digest() != data[:8]:
            raise CorruptIndexError(f"{where}: damaged Parquet footer cache (checksum)")
        try:
            doc = msgpack.unpackb(body, raw=False)
            if doc.get("format") != _FOOTERS_FORMAT or doc.get("version") != _FOOTERS_VERSION:
                raise ValueError("not a footer cache of this version")
            files = tuple(FileInfo(str(k), int(s), str(e)) for k, s, e in doc["files"])
            footers = tuple(bytes(b) for b in doc["footers"])
            if len(files) != len(footers):
                raise ValueError("files and footers differ in number")
            return cls(str(doc["url"]), files, footers)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptIndexError(f"{where}: not a Parquet footer cache ({exc})") from exc


@dataclasses.dataclass(frozen=True)
class RowGroups:
    """A Parquet prefix read for ``columns``, as units.

    ``index`` has a chunk per row group (in file order, then row group order);
    ``file_of[c]`` and ``group_of[c]`` say which file and row group chunk ``c`` is;
    ``segments[c]`` the ``(start, length)`` byte ranges of the file the unit holds, in
    order; the unit's bytes are those ranges back to back.
    """

    index: Index
    files: tuple[FileInfo, ...]
    columns: tuple[str, ...]
    schema: Any
    file_of: tuple[int, ...]
    group_of: tuple[int, ...]
    segments: tuple[tuple[tuple[int, int], ...], ...]
    metadata: tuple[Any, ...]


def row_groups(footers: Footers, columns: Sequence[str] | None, where: str = "") -> RowGroups:
    """The units of ``footers`` for ``columns`` (None: every column).

    Raises:
        CorruptFooterError: a footer pyarrow can't read, or whose ranges lie outside its
            file.
        SchemaMismatchError: a file's schema differs from the first file's (for the
            columns read), naming both files and the first difference.
        ConfigError: a column that is not in the files, or no file at all.
    """
    if not footers.files:
        raise ConfigError(f"{where or footers.url}: no Parquet files")
    base = footers.url.rstrip("/")
    metas = [
        metadata_of(fb, f"{base}/{f.key}")
        for f, fb in zip(footers.files, footers.footers, strict=True)
    ]
    first = metas[0].schema.to_arrow_schema()
    names = list(first.names)
    cols = tuple(columns) if columns is not None else tuple(names)
    missing = [c for c in cols if c not in names]
    if missing:
        raise ConfigError(
            f"{base}/{footers.files[0].key}: no column {missing[0]!r} (columns: {names})"
        )
    want = _select(first, cols)
    chunks: list[ChunkEntry] = []
    file_of: list[int] = []
    group_of: list[int] = []
    segments: list[tuple[tuple[int, int], ...]] = []
    tag = xxhash.xxh3_64("\0".join(cols).encode()).hexdigest()[:8]
    key = 0
    for fi, (info, md) in enumerate(zip(footers.files, metas, strict=True)):
        at = f"{base}/{info.key}"
        schema = md.schema.to_arrow_schema()
        got = _select(schema, cols, at) if fi else want
        if not got.equals(want):
            raise SchemaMismatchError(
                f"{at}: its schema differs from {base}/{footers.files[0].key}'s: "
                f"{_difference(want, got)}"
            )
        leaf = _leaf_columns(md, cols)
        data_end = info.size - len(footers.footers[fi])  # (the footer ends with TAIL)
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            spans = []
            for c in leaf:
                cc = rg.column(c)
                start = cc.data_page_offset
                if cc.has_dictionary_page and 0 < cc.dictionary_page_offset < start:
                    start = cc.dictionary_page_offset
                n = cc.total_compressed_size
                if start < 4 or n < 0 or start + n > data_end:
                    raise CorruptFooterError(
                        f"{at}: corrupt Parquet footer: row group {g} column "
                        f"{cc.path_in_schema} lies at [{start}, {start + n}) outside the data "
                        f"of a {info.size}-byte file"
                    )
                spans.append((start, n))
            merged = _merge(spans)
            rows = rg.num_rows
            nbytes = sum(n for _, n in merged)
            chunks.append(
                ChunkEntry(
                    f"chunk-pq-{fi}-{info.version}-{g}-{tag}.bin",
                    rows,
                    nbytes,
                    "",
                    ((key, rows),) if rows else (),
                )
            )
            key += rows
            file_of.append(fi)
            group_of.append(g)
            segments.append(tuple(merged))
    index = Index(tuple(chunks), {"source": "parquet", "columns": list(cols)})
    return RowGroups(
        index,
        footers.files,
        cols,
        want,
        tuple(file_of),
        tuple(group_of),
        tuple(segments),
        tuple(metas),
    )


def _select(schema: Any, cols: Sequence[str], where: str = "") -> Any:
    pa, _ = pyarrow_modules()
    fields = []
    for c in cols:
        i = schema.get_field_index(c)
        if i < 0:
            raise SchemaMismatchError(f"{where}: has no column {c!r} (columns: {schema.names})")
        fields.append(schema.field(i).remove_metadata())
    return pa.schema(fields)


def _difference(a: Any, b: Any) -> str:
    for fa, fb in zip(a, b, strict=False):
        if not fa.equals(fb):
            return f"column {fa.name!r} is {fa.type} there and {fb.type} here"
    return f"columns {a.names} there and {b.names} here"


def _leaf_columns(md: Any, cols: Sequence[str]) -> list[int]:
    """The leaf column numbers (in the row groups) of top-level columns ``cols``."""
    want = set(cols)
    out = []
    for i in range(md.num_columns):
        path = md.schema.column(i).path
        if path.split(".", 1)[0] in want:
            out.append(i)
    return out


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, n in sorted(spans):
        if out and start <= out[-1][0] + out[-1][1]:
            s0, n0 = out[-1]
            out[-1] = (s0, max(s0 + n0, start + n) - s0)
        else:
            out.append((start, n))
    return out
