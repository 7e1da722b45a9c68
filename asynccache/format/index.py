"""``index.json``: the dataset's table of contents, and the commit point of a write.

Schema (version 1)::

    {
      "format": "asynccache-index",
      "version": 1,
      "chunks": [
        {"filename": "chunk-0-0.bin", "items": 20, "bytes": 9472,
         "checksum": "xxh3_64:0f1e2d3c4b5a6978", "keys": [[0, 20]]},
        ...
      ],
      "total_items": 64,
      "total_bytes": 30080,
      "config": {"chunk_bytes": 8192, "chunk_size": null, "writer": "asynccache 0.1.0"},
      "index_checksum": "xxh3_64:5c0d3e1f2a4b6978"
    }

``keys`` lists the runs ``[first_key, count]`` of the keys a chunk holds, in storage
order: item ``p`` of the chunk is key ``first_key + (p - run_offset)``. Items written in
order give one run per chunk, so the index stays small however many items there are.
The keys of all chunks together are exactly ``0 .. total_items - 1``.

Per-writer indexes (``{writer}.index.json``) use the same schema plus ``"writer"`` and
``"token"`` (identifying one write pass); ``merge`` combines them into ``index.json``.

Every index the writer produces ends with ``"index_checksum": "xxh3_64:<16 hex>"``, the
checksum of the file's own bytes without that member (see :func:`seal`), so a damaged
index is refused (``CorruptIndexError``) instead of read as a different dataset. Indexes
without the member (older writers, hand-made) are still read, unverified.

Version 2 (what ``merge`` writes now) keeps ``index.json`` small: the per-chunk facts
live in a binary sidecar of columns (:mod:`.columns`) that readers map instead of
parsing; :func:`load` returns its :class:`IndexMeta`, and :meth:`IndexMeta.open` makes
the :class:`Index` from the sidecar's bytes. Version 1 stays readable.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import xxhash

from ..errors import BadIndexError, CorruptIndexError, UnsafePathError
from . import bounds
from . import columns as cols_mod
from .columns import Columns

FORMAT = "asynccache-index"
VERSION = 1
VERSION_COLUMNS = 2
INDEX_NAME = "index.json"
CHECKSUM_ALGO = "xxh3_64"
INDEX_CHECKSUM_FIELD = "index_checksum"
# The last member of a sealed index, byte for byte (docs/format.md, "Index checksum").
_SEAL = re.compile(
    rb',\n "'
    + INDEX_CHECKSUM_FIELD.encode()
    + rb'": "('
    + CHECKSUM_ALGO.encode()
    + rb':[0-9a-f]{16})"\n}\n\Z'
)
_BODY_END = "\n}\n"
_HEAD_CHECKSUM = re.compile(CHECKSUM_ALGO + r":[0-9a-f]{16}")


def new_hasher() -> Any:
    """A streaming hasher for :func:`format_checksum`."""
    return xxhash.xxh3_64()


def format_checksum(hasher: Any) -> str:
    return f"{CHECKSUM_ALGO}:{hasher.hexdigest()}"


def checksum(data: Any) -> str:
    """Checksum string of a bytes-like object, as recorded in the index."""
    h = new_hasher()
    h.update(data)
    return format_checksum(h)


def seal(body: str) -> str:
    """Append the ``index_checksum`` member to a canonical index body.

    ``body`` is ``json.dumps(doc, indent=1, sort_keys=True) + "\\n"``, so it ends with
    ``"\\n}\\n"``. The result is ``body`` with that end replaced by
    ``',\\n "index_checksum": "xxh3_64:<hex>"\\n}\\n'``, where ``<hex>`` is the xxh3_64 of
    the UTF-8 bytes of ``body``. Removing that member and putting ``"\\n}\\n"`` back gives
    ``body`` again, byte for byte: that is how a reader verifies it.
    """
    if not body.endswith(_BODY_END):
        raise ValueError("an index body must end with a closing brace on its own line")
    digest = checksum(body.encode())
    return f'{body[: -len(_BODY_END)]},\n "{INDEX_CHECKSUM_FIELD}": "{digest}"{_BODY_END}'


def verify_sealed_bytes(data: bytes, where: str) -> bool:
    """Check an index's raw bytes against the ``index_checksum`` line that ends them,
    before any parse (damage that breaks the JSON is still recognised as damage).

    Returns:
        True when that line is intact and the bytes match it; False when the bytes end
        with no such line (an unsealed index, or one whose last line itself is damaged).

    Raises:
        CorruptIndexError: the line is intact and the bytes don't match it.
    """
    m = _SEAL.search(data, max(0, len(data) - 128))  # the line is under 64 bytes
    if m is None:
        return False
    actual = checksum(data[: m.start()] + _BODY_END.encode())
    if actual != m.group(1).decode():
        raise CorruptIndexError(
            f"{where}: damaged: its bytes hash to {actual}, but it records "
            f"{INDEX_CHECKSUM_FIELD} {m.group(1).decode()}"
        )
    return True


def _verify_seal(data: bytes, doc: dict[str, Any], where: str) -> bool:
    """Check the ``index_checksum`` member of a parsed index; True when it was present.

    Raises:
        CorruptIndexError: the member is damaged, or the bytes don't match it.
    """
    if INDEX_CHECKSUM_FIELD not in doc:
        # A damaged member name would look like an older, unsealed index: a top-level
        # checksum string under any other name can only be that.
        if any(isinstance(v, str) and v.startswith(CHECKSUM_ALGO + ":") for v in doc.values()):
            raise CorruptIndexError(
                f"{where}: damaged: its {INDEX_CHECKSUM_FIELD} member is garbled"
            )
        return False
    m = _SEAL.search(data)
    if m is None or doc[INDEX_CHECKSUM_FIELD] != m.group(1).decode():
        raise CorruptIndexError(
            f"{where}: damaged or edited: its {INDEX_CHECKSUM_FIELD} member is not the "
            "last line the writer put there"
        )
    actual = checksum(data[: m.start()] + _BODY_END.encode())
    if actual != m.group(1).decode():
        raise CorruptIndexError(
            f"{where}: damaged: its bytes hash to {actual}, but it records "
            f"{INDEX_CHECKSUM_FIELD} {m.group(1).decode()}"
        )
    return True


#: The longest chunk file name, in bytes, that a file system takes.
NAME_MAX = 255


def check_filename(name: Any, where: str) -> str:
    """Refuse anything but a plain file name inside the dataset directory."""
    if not isinstance(name, str) or not name:
        raise BadIndexError(f"{where}: chunk filename must be a non-empty string, got {name!r}")
    if (
        name.startswith(("/", "\\"))
        or "\\" in name
        or "/" in name
        or posixpath.normpath(name) != name
        or name in (".", "..")
        or ":" in name
        or "\0" in name
    ):
        raise UnsafePathError(
            f"{where}: chunk filename {name!r} points outside the dataset directory"
        )
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:
        raise BadIndexError(
            f"{where}: chunk filename {name[:48]!r}... is longer than a file name may be "
            f"({NAME_MAX} bytes)"
        )
    return name


@dataclasses.dataclass(frozen=True)
class ChunkEntry:
    filename: str
    items: int
    bytes: int
    checksum: str
    keys: tuple[tuple[int, int], ...]
    #: Tokens the chunk holds (token datasets); None when the writer did not count them.
    tokens: int | None = None
    #: ``xxh3_64:<hex>`` of the chunk's header (version-2 chunks: the bytes before its
    #: first item, item checksums included); None for chunks without one.
    head: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "filename": self.filename,
            "items": self.items,
            "bytes": self.bytes,
            "checksum": self.checksum,
            "keys": [list(r) for r in self.keys],
        }
        if self.tokens is not None:
            doc["tokens"] = self.tokens
        if self.head is not None:
            doc["head"] = self.head
        return doc


def runs(keys: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Run-length encode keys in storage order: ``[3, 4, 5, 9]`` -> ``((3, 3), (9, 1))``."""
    out: list[list[int]] = []
    for k in keys:
        if out and out[-1][0] + out[-1][1] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return tuple((a, b) for a, b in out)


class LazyChunks(Sequence[ChunkEntry]):
    """The chunks of a version-2 index as :class:`ChunkEntry` objects, made on access.

    For callers that want an entry (the CLI, upload); the hot paths use the arrays.
    """

    __slots__ = ("_cols",)

    def __init__(self, cols: Columns) -> None:
        self._cols = cols

    def __len__(self) -> int:
        return len(self._cols)

    @overload
    def __getitem__(self, i: int) -> ChunkEntry: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[ChunkEntry]: ...
    def __getitem__(self, i: int | slice) -> ChunkEntry | Sequence[ChunkEntry]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"chunk {i} is out of range for {n} chunks")
        return _entry_of(self._cols, i % n)

    def __iter__(self) -> Iterator[ChunkEntry]:
        return (_entry_of(self._cols, i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} chunks>"


def _entry_of(cols: Columns, c: int) -> ChunkEntry:
    runs_ = cols.runs
    if runs_ is None:
        a, n = int(cols.item_start[c]), int(cols.items[c])
        keys: tuple[tuple[int, int], ...] = ((a, n),) if n else ()
    else:
        lo, hi = int(runs_.start[c]), int(runs_.start[c + 1])
        keys = tuple(
            (int(f), int(k)) for f, k in zip(runs_.first[lo:hi], runs_.count[lo:hi], strict=True)
        )
    ck = cols.checksums
    return ChunkEntry(
        cols.names.name(c),
        int(cols.items[c]),
        int(cols.bytes[c]),
        f"{CHECKSUM_ALGO}:{int(ck[c]):016x}" if ck is not None else "",
        keys,
        None if cols.tokens is None else int(cols.tokens[c]),
        None if cols.heads is None else f"{CHECKSUM_ALGO}:{int(cols.heads[c]):016x}",
    )


@dataclasses.dataclass(frozen=True)
class Index:
    """A parsed, validated index. ``locate(key)`` maps a key to (chunk number, position).

    Per-chunk facts are arrays (:attr:`items_per_chunk`, :meth:`locate_many`, ...): of a
    version-2 index they are views of its mapped sidecar, shared by every process that
    maps it, and :attr:`chunks` makes a :class:`ChunkEntry` only when one is asked for.
    """

    chunks: Sequence[ChunkEntry]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    writer: int | None = None
    token: str | None = None
    #: True when the file carried an ``index_checksum`` and its bytes matched it.
    verified: bool = dataclasses.field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.chunks, LazyChunks):
            object.__setattr__(self, "_cols", self.chunks._cols)

    @property
    def columns(self) -> Columns:
        """The per-chunk facts as arrays (made from :attr:`chunks` once, if not mapped)."""
        cached = self.__dict__.get("_cols")
        if cached is None:
            ch = self.chunks
            cached = cols_mod.from_lists(
                [c.items for c in ch],
                [c.bytes for c in ch],
                [c.filename for c in ch],
                [c.keys for c in ch],
                tokens=[c.tokens for c in ch],
                heads=[c.head for c in ch],
            )
            object.__setattr__(self, "_cols", cached)
        return cached

    @property
    def mapped(self) -> bool:
        """True when the per-chunk facts are a version-2 sidecar's columns."""
        return isinstance(self.chunks, LazyChunks)

    @functools.cached_property
    def total_items(self) -> int:
        return self.columns.total_items

    @functools.cached_property
    def total_bytes(self) -> int:
        return int(self.columns.bytes.sum())

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def items_per_chunk(self) -> np.ndarray:
        """Item count of each chunk (int64, read-only), in chunk order."""
        return self.columns.items

    @property
    def bytes_per_chunk(self) -> np.ndarray:
        """Byte size of each chunk file (int64, read-only), in chunk order."""
        return self.columns.bytes

    @property
    def tokens_per_chunk(self) -> np.ndarray | None:
        """Token count of each chunk (int64, read-only); None when any chunk lacks one."""
        return self.columns.tokens

    @property
    def head_checksums(self) -> np.ndarray | None:
        """The ``xxh3_64`` of each chunk's header (uint64, read-only), against which a
        header read by range is verified; None when any chunk lacks one (chunks written
        before version 2, token chunks)."""
        return self.columns.heads

    @property
    def item_start(self) -> np.ndarray:
        """Items before each chunk, and the total last (int64, ``num_chunks + 1``)."""
        return self.columns.item_start

    def filename(self, ci: int) -> str:
        """File name of chunk ``ci`` (without making its :class:`ChunkEntry`)."""
        if self.mapped:
            return self.columns.names.name(ci)
        return self.chunks[ci].filename

    def chunk_number(self, name: str) -> int | None:
        """The number of the chunk stored as ``name``, or None."""
        if self.mapped:
            return self.columns.names.number(name)
        table = self.__dict__.get("_numbers")
        if table is None:
            table = {c.filename: i for i, c in enumerate(self.chunks)}
            object.__setattr__(self, "_numbers", table)
        return table.get(name)

    def to_json(self) -> str:
        """The version-1 form (per-writer and shard indexes; small)."""
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "chunks": [c.to_json() for c in self.chunks],
            "total_items": self.total_items,
            "total_bytes": self.total_bytes,
            "config": dict(self.config),
        }
        if self.writer is not None:
            doc["writer"] = self.writer
            doc["token"] = self.token
        return seal(json.dumps(doc, indent=1, sort_keys=True) + "\n")

    def to_columns(self) -> tuple[str, bytes, str]:
        """The version-2 form: ``(sidecar name, sidecar bytes, index.json text)``.

        The sidecar is written first; ``index.json`` names it and is the commit.
        """
        c = self.columns
        if not self.mapped and len({e.filename for e in self.chunks}) != len(self.chunks):
            raise BadIndexError("index: a chunk filename appears twice")
        if c.checksums is None:
            where = "index"
            c = dataclasses.replace(
                c,
                checksums=np.asarray(
                    cols_mod.parse_checksums((e.checksum for e in self.chunks), where),
                    dtype=np.uint64,
                ),
            )
        data = cols_mod.encode(c)
        hexd = cols_mod.digest(data)
        name = cols_mod.sidecar_name(hexd)
        names = c.names
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION_COLUMNS,
            "chunks": len(c),
            "columns": {
                "filename": name,
                "bytes": len(data),
                "checksum": f"{CHECKSUM_ALGO}:{hexd}",
            },
            "names": {
                "pattern": list(names.parts) if isinstance(names, cols_mod.PatternNames) else None
            },
            "total_items": self.total_items,
            "total_bytes": self.total_bytes,
            "config": dict(self.config),
        }
        if self.writer is not None:
            doc["writer"] = self.writer
            doc["token"] = self.token
        return name, data, seal(json.dumps(doc, indent=1, sort_keys=True) + "\n")

    @property
    def checksum(self) -> str:
        """A checksum of the content (chunks and their checksums), for cache identity.

        Of a version-2 index, its sidecar's checksum (recorded in ``index.json``): nothing
        is serialized again. Of a version-1 or in-memory index, the checksum of its chunk
        list as JSON (unchanged, so existing caches keep their identity).
        """
        cached = self.__dict__.get("_checksum")
        if cached is None:  # computed once: resume states carry it with every batch
            doc = json.dumps([c.to_json() for c in self.chunks], sort_keys=True)
            cached = checksum(doc.encode())
            object.__setattr__(self, "_checksum", cached)
        return str(cached)

    def __reduce__(self) -> Any:
        # A mapped index travels as where its sidecar is, and is mapped again (a spawned
        # worker shares the node's pages instead of receiving a copy).
        opener = self.__dict__.get("_opener")
        if opener is not None:
            return opener
        # An index read from sidecar bytes (not mapped) keeps its identity as a copy.
        ident = self.__dict__.get("_checksum") if self.mapped else None
        return (
            _rebuild,
            (tuple(self.chunks), dict(self.config), self.writer, self.token, self.verified, ident),
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Index:
        """Parse, verify and validate a version-1 index.

        Raises:
            CorruptIndexError: the index carries an ``index_checksum`` its bytes don't
                match (damaged in transit or on disk).
            BadIndexError, UnsafePathError: not a valid index, or a version-2 index (whose
                columns are elsewhere: see :func:`load`). All name ``where``.
        """
        got = load(text, where)
        if isinstance(got, IndexMeta):
            raise BadIndexError(
                f"{where}: a version-2 index: its chunks are in {got.sidecar}, "
                "read it with asynccache.cache.indexfile"
            )
        return got

    # -- key lookup ---------------------------------------------------------------
    def _check_keys(self, where: str) -> None:
        ch = self.chunks
        first = np.fromiter((a for c in ch for a, _ in c.keys), np.int64)
        count = np.fromiter((n for c in ch for _, n in c.keys), np.int64)
        order = np.argsort(first, kind="stable")
        f, n = first[order], count[order]
        ends = np.concatenate([[0], np.cumsum(n)])[:-1]
        bad = (n <= 0) | (f != ends)
        if bad.any():
            j = int(np.argmax(bad))
            raise BadIndexError(
                f"{where}: item keys are not exactly 0..{self.total_items - 1}"
                f" (problem near key {min(int(f[j]), int(ends[j]))})"
            )
        for c in ch:
            if sum(k for _, k in c.keys) != c.items:
                raise BadIndexError(f"{where}: {c.filename}: keys don't add up to its item count")

    def chunk_keys(self, ci: int) -> np.ndarray:
        """The keys chunk ``ci`` holds, in storage order."""
        return self.columns.chunk_keys(ci)

    def locate_many(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`locate`: ``(chunk numbers, positions)`` of in-range ``keys``."""
        return self.columns.locate_many(keys)

    def locate(self, key: int) -> tuple[int, int]:
        """``(chunk number, position in chunk)`` of ``key``. IndexError when out of range."""
        if not 0 <= key < self.total_items:
            raise IndexError(f"index {key} is out of range for {self.total_items} items")
        c, p = self.columns.locate_many(np.asarray([key], dtype=np.int64))
        return int(c[0]), int(p[0])


def _rebuild(
    chunks: tuple[ChunkEntry, ...],
    config: dict[str, Any],
    writer: int | None,
    token: str | None,
    verified: bool,
    identity: str | None = None,
) -> Index:
    idx = Index(chunks, config, writer, token, verified=verified)
    if identity is not None:
        object.__setattr__(idx, "_checksum", identity)
    return idx


@dataclasses.dataclass(frozen=True)
class IndexMeta:
    """A version-2 ``index.json``: everything but the per-chunk facts, and where they are."""

    where: str
    chunks: int
    sidecar: str
    sidecar_bytes: int
    sidecar_checksum: str  # "xxh3_64:<hex>"
    parts: tuple[str, ...] | None
    total_items: int
    total_bytes: int
    config: Mapping[str, Any]
    writer: int | None
    token: str | None
    verified: bool

    @property
    def sidecar_hex(self) -> str:
        return self.sidecar_checksum.split(":", 1)[1]

    def open(self, buf: Any, where: str | None = None) -> Index:
        """The index whose sidecar bytes are ``buf`` (bytes, or a read-only mmap).

        Raises:
            CorruptIndexError: the sidecar is truncated or damaged.
            BadIndexError: it disagrees with ``index.json`` or is invalid (names the file).
        """
        at = where or self.sidecar
        if len(buf) != self.sidecar_bytes:
            raise CorruptIndexError(
                f"{at}: {len(buf)} bytes, but {self.where} records {self.sidecar_bytes}"
            )
        c = cols_mod.decode(buf, at, chunks=self.chunks, parts=self.parts)
        idx = Index(LazyChunks(c), dict(self.config), self.writer, self.token, self.verified)
        for name, want in (("total_items", self.total_items), ("total_bytes", self.total_bytes)):
            if getattr(idx, name) != want:
                raise BadIndexError(
                    f"{self.where}: {name} is {want} but the chunks in {at} add up to "
                    f"{getattr(idx, name)}"
                )
        object.__setattr__(idx, "_checksum", self.sidecar_checksum)
        return idx


def _meta(doc: dict[str, Any], where: str, verified: bool) -> IndexMeta:
    try:
        side = doc["columns"]
        name = side["filename"]
        if not isinstance(name, str) or not cols_mod.NAME_RE.match(name):
            raise UnsafePathError(
                f"{where}: sidecar name {name!r} is not index-<16 hex>{cols_mod.SUFFIX}"
            )
        ck, size, n = side["checksum"], side["bytes"], doc["chunks"]
        if not (isinstance(ck, str) and ck == f"{CHECKSUM_ALGO}:{name[6:22]}"):
            raise BadIndexError(f"{where}: sidecar checksum {ck!r} does not match its name")
        for what, v in (("bytes", size), ("chunks", n)):
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise BadIndexError(f"{where}: {what} must be a non-negative integer")
        _check_meta_counts(doc, where)
        pat = (doc.get("names") or {}).get("pattern")
        parts = None
        if pat is not None:
            if not (isinstance(pat, list) and pat and all(isinstance(p, str) for p in pat)):
                raise BadIndexError(f"{where}: names.pattern must be a list of strings")
            if any(any(ch.isdigit() for ch in p) for p in pat) or len(pat) > 5:
                raise BadIndexError(f"{where}: names.pattern {pat!r} is not a name pattern")
            check_filename("0".join(pat), where)
            parts = tuple(pat)
        totals = [doc["total_items"], doc["total_bytes"]]
        if not all(isinstance(v, int) and v >= 0 for v in totals):
            raise BadIndexError(f"{where}: total_items and total_bytes must be integers")
        return IndexMeta(
            where,
            n,
            name,
            size,
            ck,
            parts,
            totals[0],
            totals[1],
            dict(doc.get("config") or {}),
            doc.get("writer"),
            doc.get("token"),
            verified,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadIndexError(f"{where}: malformed index ({type(exc).__name__}: {exc})") from exc


def index_from_columns(text: str | bytes, sidecar: Any, where: str) -> Index:
    """The version-2 index whose ``index.json`` is ``text`` and sidecar bytes ``sidecar``."""
    got = load(text, where)
    if not isinstance(got, IndexMeta):
        raise BadIndexError(f"{where}: not a version-2 index")
    return got.open(sidecar)


def load(text: str | bytes, where: str) -> Index | IndexMeta:
    """Parse, verify and validate an ``index.json`` of either version.

    Version 1 gives the finished :class:`Index`; version 2 its :class:`IndexMeta`, which
    opens the sidecar the caller fetched or mapped.

    Raises:
        CorruptIndexError: its ``index_checksum`` does not match its bytes.
        BadIndexError, UnsafePathError: not a valid index. All name ``where``.
    """
    data = text.encode() if isinstance(text, str) else bytes(text)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadIndexError(f"{where}: not valid JSON ({exc})") from exc
    # Verified before anything else is read: a damaged key or value must be reported
    # as damage, not as whatever schema error it happens to look like.
    verified = isinstance(doc, dict) and _verify_seal(data, doc, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BadIndexError(f"{where}: not an asynccache index (missing format marker)")
    if doc.get("version") == VERSION_COLUMNS:
        return _meta(doc, where, verified)
    if doc.get("version") != VERSION:
        raise BadIndexError(
            f"{where}: index version {doc.get('version')!r} is not "
            f"supported (this release reads versions {VERSION} and {VERSION_COLUMNS})"
        )
    try:
        chunks: Any = []
        first = 0
        if not isinstance(doc["chunks"], list):
            kind = type(doc["chunks"]).__name__
            raise BadIndexError(f"{where}: chunks must be a list, got {kind}")
        _check_header_fields(doc, where)
        for i, c in enumerate(doc["chunks"]):  # without "keys": continues where the last ended
            chunks.append(_entry(c, where, first, f"chunks[{i}]"))
            first = bounds.count(first + chunks[-1].items, "total_items", where)
        chunks = tuple(chunks)
        idx = Index(
            chunks,
            dict(doc.get("config") or {}),
            doc.get("writer"),
            doc.get("token"),
            verified=verified,
        )
        totals = {
            "total_items": first,
            "total_bytes": bounds.count(sum(c.bytes for c in chunks), "total_bytes", where),
        }
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, BadIndexError):
            raise
        raise BadIndexError(f"{where}: malformed index ({type(exc).__name__}: {exc})") from exc
    for name, got in totals.items():
        if name in doc and doc[name] != got:
            raise BadIndexError(f"{where}: {name} is {doc[name]} but the chunks add up to {got}")
    if len({c.filename for c in chunks}) != len(chunks):
        raise BadIndexError(f"{where}: a chunk filename appears twice")
    if idx.writer is None:
        idx._check_keys(where)
    return idx


def _entry(c: Mapping[str, Any], where: str, first: int, at: str = "chunk") -> ChunkEntry:
    if not isinstance(c, dict):
        raise BadIndexError(f"{where}: {at} must be an object, got {type(c).__name__}")
    name = check_filename(c["filename"], where)
    items, size, ck = c["items"], c["bytes"], c["checksum"]
    items = bounds.count(items, f"{at}.items ({name})", where)
    size = bounds.count(size, f"{at}.bytes ({name})", where)
    bounds.fits(items, size, f"{at}.items ({name})", where)
    if not (isinstance(ck, str) and ck.startswith(CHECKSUM_ALGO + ":")):
        raise BadIndexError(f"{where}: {name}: checksum {ck!r} is not {CHECKSUM_ALGO}")
    tokens = c.get("tokens")
    if tokens is not None and not (
        isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    ):
        raise BadIndexError(f"{where}: {name}: tokens must be a non-negative integer")
    if tokens is not None:
        bounds.tokens_fit(bounds.count(tokens, f"{at}.tokens", where), size, at, where)
    head = c.get("head")
    if head is not None and not (
        isinstance(head, str) and _HEAD_CHECKSUM.fullmatch(head) is not None
    ):
        raise BadIndexError(f"{where}: {name}: head {head!r} is not {CHECKSUM_ALGO}:<16 hex>")
    default = [[first, items]] if items else []
    keys = _key_runs(c.get("keys", default), items, where, f"{at}.keys ({name})")
    return ChunkEntry(name, items, size, ck, keys, tokens, head)


def _key_runs(raw: Any, items: int, where: str, at: str) -> tuple[tuple[int, int], ...]:
    """A chunk's ``keys``: at most ``items`` runs ``[first, count]`` of real integers,
    ``first`` from 0 and ``count`` from 1 (each run holds at least one of its items)."""
    if not isinstance(raw, list) or len(raw) > items:
        raise BadIndexError(f"{where}: {at} must be a list of at most {items} [first, count] runs")
    out = []
    for j, run in enumerate(raw):
        if not (isinstance(run, list) and len(run) == 2):
            raise BadIndexError(f"{where}: {at}[{j}] must be a [first, count] pair")
        out.append(
            (
                bounds.count(run[0], f"{at}[{j}][0]", where),
                bounds.count(run[1], f"{at}[{j}][1]", where, least=1),
            )
        )
    return tuple(out)


def _check_header_fields(doc: Mapping[str, Any], where: str) -> None:
    """``config`` an object, ``writer`` a count and ``token`` a string, where present."""
    config = doc.get("config")
    if config is not None and not isinstance(config, dict):
        raise BadIndexError(f"{where}: config must be an object, got {type(config).__name__}")
    bounds.optional_count(doc.get("writer"), "writer", where)
    token = doc.get("token")
    if token is not None and not isinstance(token, str):
        raise BadIndexError(f"{where}: token must be a string, got {type(token).__name__}")


def _check_meta_counts(doc: Mapping[str, Any], where: str) -> None:
    """A version-2 ``index.json``'s counts against each other, before its sidecar is
    fetched: each chunk takes at least 32 bytes of the sidecar (its items, bytes,
    checksum and item start), each item at least its offset entry of the chunks' bytes."""
    _check_header_fields(doc, where)
    n = bounds.count(doc["chunks"], "chunks", where)
    size = bounds.count(doc["columns"]["bytes"], "columns.bytes", where)
    items = bounds.count(doc["total_items"], "total_items", where)
    total_bytes = bounds.count(doc["total_bytes"], "total_bytes", where)
    if n > size // 32:
        raise BadIndexError(
            f"{where}: chunks: {n} chunks can't be described by a sidecar of {size} bytes "
            "(columns.bytes)"
        )
    bounds.fits(items, total_bytes, "total_items", where)


def merge(parts: Iterable[Index], config: Mapping[str, Any] | None = None) -> Index:
    """Combine per-writer indexes into one; chunks ordered by their first key.

    Raises:
        BadIndexError: the writers' keys overlap or leave gaps.
    """
    chunks = sorted(
        (c for p in parts for c in p.chunks),
        key=lambda c: (min((k for k, _ in c.keys), default=-1), c.filename),
    )
    merged = Index(tuple(chunks), dict(config or {}))
    merged._check_keys("merged index")
    return merged
