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
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import xxhash

from ..errors import BadIndexError, CorruptIndexError, UnsafePathError

FORMAT = "asynccache-index"
VERSION = 1
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
    ):
        raise UnsafePathError(
            f"{where}: chunk filename {name!r} points outside the dataset directory"
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


@dataclasses.dataclass(frozen=True)
class Index:
    """A parsed, validated index. ``locate(key)`` maps a key to (chunk number, position)."""

    chunks: tuple[ChunkEntry, ...]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    writer: int | None = None
    token: str | None = None
    #: True when the file carried an ``index_checksum`` and its bytes matched it.
    verified: bool = dataclasses.field(default=False, compare=False, repr=False)

    @functools.cached_property
    def total_items(self) -> int:
        return sum(c.items for c in self.chunks)

    @functools.cached_property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.chunks)

    @functools.cached_property
    def items_per_chunk(self) -> np.ndarray:
        """Item count of each chunk (int64, read-only), in chunk order."""
        return _frozen(np.fromiter((c.items for c in self.chunks), np.int64, len(self.chunks)))

    @functools.cached_property
    def bytes_per_chunk(self) -> np.ndarray:
        """Byte size of each chunk file (int64, read-only), in chunk order."""
        return _frozen(np.fromiter((c.bytes for c in self.chunks), np.int64, len(self.chunks)))

    @functools.cached_property
    def tokens_per_chunk(self) -> np.ndarray | None:
        """Token count of each chunk (int64, read-only); None when any chunk lacks one."""
        if any(c.tokens is None for c in self.chunks):
            return None
        return _frozen(
            np.fromiter((int(c.tokens or 0) for c in self.chunks), np.int64, len(self.chunks))
        )

    def to_json(self) -> str:
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

    @property
    def checksum(self) -> str:
        """A checksum of the content (chunks and their checksums), for cache identity."""
        cached = self.__dict__.get("_checksum")
        if cached is None:  # computed once: resume states carry it with every batch
            doc = json.dumps([c.to_json() for c in self.chunks], sort_keys=True)
            cached = checksum(doc.encode())
            object.__setattr__(self, "_checksum", cached)
        return str(cached)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Index:
        """Parse, verify and validate.

        Raises:
            CorruptIndexError: the index carries an ``index_checksum`` its bytes don't
                match (damaged in transit or on disk).
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
        if doc.get("version") != VERSION:
            raise BadIndexError(
                f"{where}: index version {doc.get('version')!r} is not "
                f"supported (this release reads version {VERSION})"
            )
        try:
            chunks: Any = []
            first = 0
            for c in doc["chunks"]:  # a chunk without "keys" continues where the last ended
                chunks.append(_entry(c, where, first))
                first += chunks[-1].items
            chunks = tuple(chunks)
            idx = cls(
                chunks,
                dict(doc.get("config") or {}),
                doc.get("writer"),
                doc.get("token"),
                verified=verified,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, BadIndexError):
                raise
            raise BadIndexError(f"{where}: malformed index ({type(exc).__name__}: {exc})") from exc
        for name in ("total_items", "total_bytes"):
            if name in doc and doc[name] != getattr(idx, name):
                raise BadIndexError(
                    f"{where}: {name} is {doc[name]} but the chunks add up to {getattr(idx, name)}"
                )
        if len({c.filename for c in chunks}) != len(chunks):
            raise BadIndexError(f"{where}: a chunk filename appears twice")
        if idx.writer is None:
            idx._check_keys(where)
        return idx

    # -- key lookup ---------------------------------------------------------------
    def _table(self) -> tuple[list[int], list[tuple[int, int, int]]]:
        cached = self.__dict__.get("_tbl")
        if cached is None:
            rows = []
            for ci, c in enumerate(self.chunks):
                pos = 0
                for first, count in c.keys:
                    rows.append((first, count, ci, pos))
                    pos += count
            rows.sort()
            cached = ([r[0] for r in rows], [(r[1], r[2], r[3]) for r in rows])
            object.__setattr__(self, "_tbl", cached)
        return cached

    def _check_keys(self, where: str) -> None:
        starts, rest = self._table()
        expect = 0
        for first, (count, _ci, _pos) in zip(starts, rest, strict=True):
            if first != expect or count <= 0:
                raise BadIndexError(
                    f"{where}: item keys are not exactly 0..{self.total_items - 1}"
                    f" (problem near key {min(first, expect)})"
                )
            expect += count
        for c in self.chunks:
            if sum(n for _, n in c.keys) != c.items:
                raise BadIndexError(f"{where}: {c.filename}: keys don't add up to its item count")

    def chunk_keys(self, ci: int) -> np.ndarray:
        """The keys chunk ``ci`` holds, in storage order."""
        runs_ = self.chunks[ci].keys
        if not runs_:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in runs_])

    def locate_many(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`locate`: ``(chunk numbers, positions)`` of in-range ``keys``."""
        starts, rest = self._table()
        arr = self.__dict__.get("_arr")
        if arr is None:
            arr = (
                np.asarray(starts, dtype=np.int64),
                np.asarray([r[1] for r in rest], dtype=np.int64),
                np.asarray([r[2] for r in rest], dtype=np.int64),
            )
            object.__setattr__(self, "_arr", arr)
        s, chunk, pos = arr
        r = np.searchsorted(s, keys, side="right") - 1
        return chunk[r], pos[r] + (keys - s[r])

    def locate(self, key: int) -> tuple[int, int]:
        """``(chunk number, position in chunk)`` of ``key``. IndexError when out of range."""
        if not 0 <= key < self.total_items:
            raise IndexError(f"index {key} is out of range for {self.total_items} items")
        starts, rest = self._table()
        r = bisect.bisect_right(starts, key) - 1
        _count, ci, pos = rest[r]
        return ci, pos + (key - starts[r])


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _entry(c: Mapping[str, Any], where: str, first: int) -> ChunkEntry:
    name = check_filename(c["filename"], where)
    items, size, ck = c["items"], c["bytes"], c["checksum"]
    if not (isinstance(items, int) and items >= 0 and isinstance(size, int) and size >= 0):
        raise BadIndexError(f"{where}: {name}: items and bytes must be non-negative integers")
    if not (isinstance(ck, str) and ck.startswith(CHECKSUM_ALGO + ":")):
        raise BadIndexError(f"{where}: {name}: checksum {ck!r} is not {CHECKSUM_ALGO}")
    tokens = c.get("tokens")
    if tokens is not None and not (
        isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    ):
        raise BadIndexError(f"{where}: {name}: tokens must be a non-negative integer")
    keys = tuple((int(a), int(b)) for a, b in c.get("keys", [[first, items]]))
    return ChunkEntry(name, items, size, ck, keys, tokens)


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
