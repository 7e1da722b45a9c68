"""The columns of a version-2 index: per-chunk facts numpy maps without parsing.

A version-2 ``index.json`` is small; the facts of every chunk live in a sidecar,
``index-<hex>.cols`` (``<hex>``: the xxh3_64 of the sidecar's bytes), laid out so that
every column is an array at a fixed offset. Readers map it read-only: the pages are
shared by every process on the node, and nothing is parsed per chunk. See
``docs/format.md``, "Index version 2".

Layout, all integers little-endian::

    0    8   magic b"ACIDXCOL"
    8    4   u32 layout version (1)
    12   4   u32 number of columns C
    16   8   u64 chunks N
    24   8   u64 key runs R (0: the keys are sequential, see below)
    32   32  zero
    64   48C directory, one entry per column: name (16 bytes, NUL-padded ASCII), numpy
             dtype (8 bytes, NUL-padded, e.g. "<i8"), offset u64, count u64, zero u64
    ...      the columns, each at a multiple of 64
    end-8 8  u64 xxh3_64 of every byte before it

Columns (``[N]``: one per chunk, ``[N+1]``: a start per chunk and the end):

* ``items`` <i8 [N], ``bytes`` <i8 [N], ``checksum`` <u8 [N] (the chunk's xxh3_64),
  ``item_start`` <i8 [N+1] (items before the chunk, in chunk order);
* ``tokens`` <i8 [N], when every chunk's token count is known;
* ``head`` <u8 [N], the xxh3_64 of each chunk's header (version-2 chunks), when every
  chunk has one: a header read by range is verified against it;
* names: ``name_0`` .. ``name_{k-1}`` <i8 [N], the numbers of the file name pattern that
  ``index.json`` records (``chunk-{}-{}.bin``), or, when names follow no pattern,
  ``name_start`` <i8 [N+1] and ``name_bytes`` |u1 (UTF-8, concatenated);
* keys: when R is 0, chunk ``c`` holds keys ``item_start[c] .. item_start[c+1]-1`` in
  order (what a writer produces in the common case). Otherwise ``run_start`` <i8 [N+1],
  ``run_first`` <i8 [R], ``run_count`` <i8 [R] are each chunk's key runs in storage
  order, and ``key_first``, ``key_chunk``, ``key_pos`` <i8 [R] are the same runs sorted by
  first key (with the chunk and the position in it where each starts), for lookups.

Pure: bytes in, arrays out.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import BadIndexError, CorruptIndexError
from . import bounds

MAGIC = b"ACIDXCOL"
LAYOUT = 1
SUFFIX = ".cols"
_HEAD = struct.Struct("<8sIIQQ32x")
_DIR = struct.Struct("<16s8sQQ8x")
_ALIGN = 64
_TRAILER = 8
_DTYPES: dict[str, np.dtype[Any]] = {
    "<i8": np.dtype("<i8"),
    "<u8": np.dtype("<u8"),
    "|u1": np.dtype("u1"),
}
_MAX_FIELDS = 4
_FIELD = re.compile(r"(\d+)")
#: File names of sidecars: ``index-<16 hex>.cols``.
NAME_RE = re.compile(r"\Aindex-[0-9a-f]{16}\.cols\Z")


def sidecar_name(digest_hex: str) -> str:
    return f"index-{digest_hex}{SUFFIX}"


def _frozen(a: np.ndarray) -> np.ndarray:
    if a.flags.writeable:
        a.flags.writeable = False
    return a


# -- names --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class PatternNames:
    """Names made of fixed text and numbers: ``parts[0] + str(f0) + parts[1] + ...``."""

    parts: tuple[str, ...]
    fields: tuple[np.ndarray, ...]

    def name(self, c: int) -> str:
        out = [self.parts[0]]
        for f, p in zip(self.fields, self.parts[1:], strict=True):
            out += [str(int(f[c])), p]
        return "".join(out)

    def number(self, name: str) -> int | None:
        got = _FIELD.split(name)
        if tuple(got[0::2]) != self.parts or any(str(int(d)) != d for d in got[1::2]):
            return None
        if not self.fields:
            return 0 if len(got) == 1 else None
        uniq, order, keys = self._lookup()
        if keys is None:  # too many distinct numbers for one int64 rank: a table
            table = self.__dict__.get("_map")
            if table is None:
                rows = zip(*(f.tolist() for f in self.fields), strict=True)
                table = {r: c for c, r in enumerate(rows)}
                object.__setattr__(self, "_map", table)
            return table.get(tuple(int(d) for d in got[1::2]))
        key = 0
        for u, d in zip(uniq, got[1::2], strict=True):
            j = int(np.searchsorted(u, int(d)))
            if j >= len(u) or u[j] != int(d):
                return None
            key = key * len(u) + j
        i = int(np.searchsorted(keys, key))
        return int(order[i]) if i < len(keys) and keys[i] == key else None

    def _lookup(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray | None]:
        """Each number's distinct values, and the chunks sorted by their names' rank
        (mixed radix over those values): built on the first lookup, arrays only."""
        cached = self.__dict__.get("_lk")
        if cached is None:
            uniq, keys = [], np.zeros(len(self.fields[0]), dtype=np.int64)
            radix = 1
            for f in self.fields:
                u, inv = np.unique(f, return_inverse=True)
                keys = keys * len(u) + inv
                uniq.append(u)
                radix *= len(u)
            if radix >= 1 << 62:
                cached = (uniq, keys[:0], None)
            else:
                order = np.argsort(keys, kind="stable")
                cached = (uniq, order, keys[order])
            object.__setattr__(self, "_lk", cached)
        return cached


def _combined(fields: Sequence[np.ndarray]) -> np.ndarray | None:
    """One int64 per chunk that orders and identifies its name's numbers (None: too big)."""
    if not fields:
        return None
    if len(fields) == 1:
        return np.asarray(fields[0], dtype=np.int64)
    if (
        len(fields) == 2
        and len(fields[0])
        and max(int(fields[0].max()), int(fields[1].max())) < (1 << 31)
    ):
        return (np.asarray(fields[0], np.int64) << 31) | np.asarray(fields[1], np.int64)
    if len(fields) == 2 and not len(fields[0]):
        return np.empty(0, np.int64)
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class TableNames:
    """Names that follow no pattern: UTF-8 bytes, one slice per chunk."""

    start: np.ndarray
    blob: np.ndarray

    def name(self, c: int) -> str:
        return bytes(self.blob[int(self.start[c]) : int(self.start[c + 1])]).decode()

    def number(self, name: str) -> int | None:
        table = self.__dict__.get("_map")
        if table is None:  # only for callers that look names up (rare): built on demand
            table = {self.name(c): c for c in range(len(self.start) - 1)}
            object.__setattr__(self, "_map", table)
        return table.get(name)


Names = PatternNames | TableNames


def pattern_of(names: Sequence[str]) -> tuple[tuple[str, ...], list[list[int]]] | None:
    """The fixed text and numbers of ``names`` when they share one pattern, else None.

    A number qualifies only written plainly (``7``, not ``07``), so that the pattern gives
    every name back exactly.
    """
    parts: tuple[str, ...] | None = None
    cols: list[list[int]] = []
    for name in names:
        got = _FIELD.split(name)
        text, nums = tuple(got[0::2]), got[1::2]
        if parts is None:
            parts = text
            if len(nums) > _MAX_FIELDS:
                return None
            cols = [[] for _ in nums]
        elif text != parts:
            return None
        for col, d in zip(cols, nums, strict=True):
            v = int(d)
            if str(v) != d or v >= 1 << 62:
                return None
            col.append(v)
    if parts is None:
        return None
    return parts, cols


# -- keys ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class KeyRuns:
    """Each chunk's key runs in storage order, and the same runs sorted by first key."""

    start: np.ndarray  # [N+1] into first/count
    first: np.ndarray
    count: np.ndarray
    key_first: np.ndarray
    key_chunk: np.ndarray
    key_pos: np.ndarray


def key_runs(start: np.ndarray, first: np.ndarray, count: np.ndarray) -> KeyRuns:
    """:class:`KeyRuns` from storage-order runs (computes the sorted lookup table)."""
    n = len(start) - 1
    per = np.diff(start)
    chunk = np.repeat(np.arange(n, dtype=np.int64), per)
    excl = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(count, out=excl[1:])
    pos = excl[:-1] - np.repeat(excl[start[:-1]], per)
    order = np.argsort(first, kind="stable")
    return KeyRuns(start, first, count, first[order], chunk[order], pos[order])


# -- the columns --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Columns:
    """The per-chunk facts of an index as arrays (mapped or in memory); read-only."""

    items: np.ndarray
    bytes: np.ndarray
    item_start: np.ndarray
    names: Names
    checksums: np.ndarray | None = None
    tokens: np.ndarray | None = None
    runs: KeyRuns | None = None
    heads: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.items)

    @property
    def total_items(self) -> int:
        return int(self.item_start[-1])

    def chunk_keys(self, c: int) -> np.ndarray:
        if self.runs is None:
            return np.arange(self.item_start[c], self.item_start[c + 1], dtype=np.int64)
        r = self.runs
        a, b = int(r.start[c]), int(r.start[c + 1])
        if a == b:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(
            [
                np.arange(f, f + k, dtype=np.int64)
                for f, k in zip(r.first[a:b], r.count[a:b], strict=True)
            ]
        )

    def locate_many(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = np.asarray(keys, dtype=np.int64)
        if self.runs is None:
            c = np.searchsorted(self.item_start, keys, side="right") - 1
            return c, keys - self.item_start[c]
        r = self.runs
        j = np.searchsorted(r.key_first, keys, side="right") - 1
        return r.key_chunk[j], r.key_pos[j] + (keys - r.key_first[j])


def from_lists(
    items: Sequence[int],
    sizes: Sequence[int],
    names: Sequence[str],
    keys: Sequence[Sequence[tuple[int, int]]],
    checksums: Sequence[int] | None = None,
    tokens: Sequence[int | None] | None = None,
    heads: Sequence[str | None] | None = None,
) -> Columns:
    """Columns of chunks given as lists (what a writer or a version-1 index has).
    ``heads``: each chunk's header checksum (``xxh3_64:<hex>``), kept only when every
    chunk has one."""
    n = len(items)
    it = np.fromiter(items, np.int64, n)
    start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(it, out=start[1:])
    pat = pattern_of(names)
    nm: Names
    if pat is not None:
        nm = PatternNames(pat[0], tuple(_frozen(np.asarray(f, np.int64)) for f in pat[1]))
    else:
        raw = [s.encode() for s in names]
        ns = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(b) for b in raw], out=ns[1:])
        nm = TableNames(_frozen(ns), _frozen(np.frombuffer(b"".join(raw), np.uint8).copy()))
    runs_ = None
    sequential = all(
        (len(k) == 1 and k[0][0] == s and k[0][1] == i) or (not k and i == 0)
        for k, s, i in zip(keys, start[:-1].tolist(), items, strict=True)
    )
    if not sequential:
        rs = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(k) for k in keys], out=rs[1:])
        first = np.fromiter((a for k in keys for a, _ in k), np.int64, int(rs[-1]))
        count = np.fromiter((b for k in keys for _, b in k), np.int64, int(rs[-1]))
        runs_ = key_runs(rs, first, count)
        for a in dataclasses.astuple(runs_):
            _frozen(a)
    tk = None
    if tokens is not None and all(t is not None for t in tokens):
        tk = _frozen(np.fromiter((int(t or 0) for t in tokens), np.int64, n))
    ck = None if checksums is None else _frozen(np.fromiter(checksums, np.uint64, n))
    hd = None
    if heads is not None and all(h is not None for h in heads):
        hd = _frozen(np.fromiter((int(str(h).split(":", 1)[1], 16) for h in heads), np.uint64, n))
    return Columns(
        _frozen(it),
        _frozen(np.fromiter(sizes, np.int64, n)),
        _frozen(start),
        nm,
        ck,
        tk,
        runs_,
        hd,
    )


def encode(cols: Columns) -> bytes:
    """The sidecar's bytes (``cols.checksums`` must be set)."""
    if cols.checksums is None:
        raise ValueError("encode needs the chunk checksums")
    named: list[tuple[str, np.ndarray]] = [
        ("items", cols.items),
        ("bytes", cols.bytes),
        ("checksum", cols.checksums),
        ("item_start", cols.item_start),
    ]
    if cols.tokens is not None:
        named.append(("tokens", cols.tokens))
    if cols.heads is not None:
        named.append(("head", cols.heads))
    if isinstance(cols.names, PatternNames):
        named += [(f"name_{i}", f) for i, f in enumerate(cols.names.fields)]
    else:
        named += [("name_start", cols.names.start), ("name_bytes", cols.names.blob)]
    r = cols.runs
    if r is not None:
        named += [
            ("run_start", r.start),
            ("run_first", r.first),
            ("run_count", r.count),
            ("key_first", r.key_first),
            ("key_chunk", r.key_chunk),
            ("key_pos", r.key_pos),
        ]
    out = bytearray()
    pos = _align(_HEAD.size + _DIR.size * len(named))
    directory = []
    for name, arr in named:
        dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        code = "|u1" if dt.itemsize == 1 else dt.str
        directory.append(_DIR.pack(name.encode(), code.encode(), pos, len(arr)))
        pos = _align(pos + arr.nbytes)
    out += _HEAD.pack(MAGIC, LAYOUT, len(named), len(cols), 0 if r is None else len(r.first))
    for d in directory:
        out += d
    for _name, arr in named:
        out += b"\0" * (_align(len(out)) - len(out))
        out += np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    out += b"\0" * (_align(len(out)) - len(out))
    out += struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(out)))
    return bytes(out)


#: The longest chunk file name a sidecar's name table is allowed to hold, for
#: :func:`max_size` (object keys of S3 and GCS end at 1024 bytes).
MAX_NAME_BYTES = 1024


def max_size(chunks: int, items: int, name_fields: int | None) -> int:
    """The most bytes a sidecar of ``chunks`` chunks holding ``items`` items can take:
    every optional column present (tokens, one key run per item), names made of
    ``name_fields`` numbers (None: a table of names, each at most ``MAX_NAME_BYTES``).
    Pure arithmetic on what ``index.json`` states, for refusing an absurd sidecar size
    before fetching it."""
    ncols = 6 + 6 + (name_fields if name_fields is not None else 2)
    per_chunk = 8 * 7  # items, bytes, checksum, item_start, tokens, a spare, run_start
    per_chunk += 8 * name_fields if name_fields is not None else 8 + MAX_NAME_BYTES
    per_item = 8 * 5  # run_first, run_count, key_first, key_chunk, key_pos
    head = _align(_HEAD.size + _DIR.size * ncols)
    return head + ncols * (_ALIGN + 8) + chunks * per_chunk + items * per_item + _TRAILER


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def digest(data: Any) -> str:
    """The hex xxh3_64 of a sidecar's bytes (names it; its checksum in ``index.json``)."""
    return xxhash.xxh3_64_hexdigest(data)


def decode(buf: Any, where: str, *, chunks: int, parts: tuple[str, ...] | None) -> Columns:
    """The columns of a sidecar's bytes (``buf``: bytes or a read-only mmap), validated.

    ``chunks`` and ``parts`` are what ``index.json`` records (chunk count, name pattern).
    The arrays are views of ``buf``: nothing is copied.

    Raises:
        CorruptIndexError: truncated, or the trailing checksum does not match.
        BadIndexError: lengths or values that disagree, unsafe names. All name ``where``.
    """
    size = len(buf)
    if size < _HEAD.size + _TRAILER:
        raise CorruptIndexError(f"{where}: truncated ({size} bytes)")
    # Checked first: damage must be reported as damage, not as what it happens to break.
    (want,) = struct.unpack_from("<Q", buf, size - _TRAILER)
    got = xxhash.xxh3_64_intdigest(memoryview(buf)[: size - _TRAILER])
    if got != want:
        raise CorruptIndexError(
            f"{where}: damaged or truncated: its bytes hash to {got:016x}, it records {want:016x}"
        )
    magic, layout, ncols, n, nruns = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadIndexError(f"{where}: not an asynccache index sidecar (bad magic)")
    if layout != LAYOUT:
        raise BadIndexError(f"{where}: sidecar layout {layout} is not supported (reads {LAYOUT})")
    if n != chunks:
        raise BadIndexError(f"{where}: holds {n} chunks, index.json says {chunks}")
    if ncols > 64 or _HEAD.size + _DIR.size * ncols > size - _TRAILER:
        raise BadIndexError(f"{where}: column directory of {ncols} entries does not fit")
    arrays: dict[str, np.ndarray] = {}
    for i in range(ncols):
        raw_name, raw_dt, off, count = _DIR.unpack_from(buf, _HEAD.size + _DIR.size * i)
        name = raw_name.rstrip(b"\0").decode("ascii", "replace")
        dt = _DTYPES.get(raw_dt.rstrip(b"\0").decode("ascii", "replace"))
        if dt is None:
            raise BadIndexError(f"{where}: column {name!r} has an unknown type {raw_dt!r}")
        if off % _ALIGN or off + count * dt.itemsize > size - _TRAILER or count > size:
            raise BadIndexError(f"{where}: column {name!r} lies outside the file")
        arrays[name] = _frozen(np.frombuffer(buf, dtype=dt, count=count, offset=off))

    def col(name: str, length: int, dtype: str = "<i8") -> np.ndarray:
        a = arrays.get(name)
        if a is None:
            raise BadIndexError(f"{where}: column {name!r} is missing")
        if len(a) != length or a.dtype != _DTYPES[dtype]:
            raise BadIndexError(
                f"{where}: column {name!r} has {len(a)} values of {a.dtype}, "
                f"expected {length} of {dtype}"
            )
        return a

    items, sizes = col("items", n), col("bytes", n)
    checks, start = col("checksum", n, "<u8"), col("item_start", n + 1)
    if n and (items.min() < 0 or sizes.min() < 0):
        raise BadIndexError(f"{where}: items and bytes must be non-negative")
    if start[0] != 0 or not np.array_equal(np.diff(start), items):
        raise BadIndexError(f"{where}: item_start does not add up the item counts")
    # int64 differences wrap: a start past int64's end can still differ by the counts.
    if (start[1:] < start[:-1]).any():
        raise BadIndexError(f"{where}: item_start does not add up the item counts")
    bounds.columns_fit(items, sizes, col("tokens", n) if "tokens" in arrays else None, where)
    tokens = col("tokens", n) if "tokens" in arrays else None
    if tokens is not None and n and tokens.min() < 0:
        raise BadIndexError(f"{where}: tokens must be non-negative")
    heads = col("head", n, "<u8") if "head" in arrays else None
    names: Names
    if parts is not None:
        fields = tuple(col(f"name_{i}", n) for i in range(len(parts) - 1))
        if any(len(f) and f.min() < 0 for f in fields):
            raise BadIndexError(f"{where}: a chunk name number is negative")
        names = PatternNames(parts, fields)
        keys = _combined(fields)
        if keys is not None and len(keys) > 1:
            s = np.sort(keys)
            if (s[1:] == s[:-1]).any():
                raise BadIndexError(f"{where}: a chunk filename appears twice")
        elif keys is None and n > 1 and _rows_repeat(fields):
            raise BadIndexError(f"{where}: a chunk filename appears twice")
    else:
        ns = col("name_start", n + 1)
        blob = arrays.get("name_bytes")
        if blob is None or blob.dtype != np.uint8:
            raise BadIndexError(f"{where}: column 'name_bytes' is missing")
        lens = np.diff(ns)
        if ns[0] != 0 or ns[-1] != len(blob) or (n and lens.min() <= 0):
            raise BadIndexError(f"{where}: name_start does not match the name bytes")
        if (ns[1:] <= ns[:-1]).any():  # (wrapped differences, as for item_start)
            raise BadIndexError(f"{where}: name_start does not match the name bytes")
        names = TableNames(ns, blob)
        _check_table(names, lens, where)
    runs_ = None
    if nruns:
        runs_ = KeyRuns(
            col("run_start", n + 1),
            col("run_first", nruns),
            col("run_count", nruns),
            col("key_first", nruns),
            col("key_chunk", nruns),
            col("key_pos", nruns),
        )
        _check_runs(runs_, items, int(start[-1]), where)
    return Columns(items, sizes, start, names, checks, tokens, runs_, heads)


def _rows_repeat(fields: Sequence[np.ndarray]) -> bool:
    """Whether two chunks have the same numbers in every field (the same name), for the
    patterns :func:`_combined` can't fold into one int64 (no numbers, or large ones)."""
    if not fields:
        return True  # every chunk has the pattern's one fixed name
    order = np.lexsort(fields)
    same = np.ones(len(order) - 1, dtype=bool)
    for f in fields:
        g = f[order]
        same &= g[1:] == g[:-1]
    return bool(same.any())


def _check_table(names: TableNames, lens: np.ndarray, where: str) -> None:
    blob = names.blob
    bad = np.isin(blob, np.frombuffer(b"/\\:\0", np.uint8))
    if bad.any():
        c = int(np.searchsorted(names.start, int(np.argmax(bad)), side="right") - 1)
        shown = bytes(blob[int(names.start[c]) : int(names.start[c + 1])])  # maybe not UTF-8
        raise BadIndexError(
            f"{where}: chunk filename {shown.decode(errors='replace')!r} points outside the "
            "dataset directory"
        )
    starts = names.start[:-1]
    dot = blob[starts] == ord(".") if len(blob) else np.zeros(0, bool)
    two = np.zeros_like(dot)
    has2 = lens >= 2
    two[has2] = blob[starts[has2] + 1] == ord(".")
    if ((lens == 1) & dot).any() or ((lens == 2) & dot & two).any():
        raise BadIndexError(f"{where}: a chunk filename is '.' or '..'")
    try:
        bytes(blob).decode()
    except UnicodeDecodeError as exc:
        raise BadIndexError(f"{where}: chunk filenames are not UTF-8") from exc
    # Each name must decode on its own: none may start inside another's character.
    if len(blob) and ((blob[starts] & 0xC0) == 0x80).any():
        raise BadIndexError(f"{where}: a chunk filename starts inside a UTF-8 character")


def _check_runs(r: KeyRuns, items: np.ndarray, total: int, where: str) -> None:
    bad = BadIndexError(f"{where}: item keys are not exactly 0..{total - 1}")
    if r.start[0] != 0 or r.start[-1] != len(r.first) or (np.diff(r.start) < 0).any():
        raise bad
    if (r.count <= 0).any():
        raise bad
    if (r.start[1:] < r.start[:-1]).any() or (r.first < 0).any():
        raise bad
    bounds.total(r.count, "the key runs' counts", where)
    ends = np.concatenate([[0], np.cumsum(r.count)])
    if not np.array_equal(ends[r.start[1:]] - ends[r.start[:-1]], items):
        raise BadIndexError(f"{where}: a chunk's keys don't add up to its item count")
    ref = key_runs(np.asarray(r.start), np.asarray(r.first), np.asarray(r.count))
    order = np.argsort(r.first, kind="stable")
    if not (
        np.array_equal(ref.key_first, r.key_first)
        and np.array_equal(ref.key_chunk, r.key_chunk)
        and np.array_equal(ref.key_pos, r.key_pos)
    ):
        raise BadIndexError(f"{where}: the key lookup table disagrees with the chunks' keys")
    kf, kc = r.key_first, r.count[order]
    if len(kf) and (kf[0] != 0 or not np.array_equal(kf[1:], kf[:-1] + kc[:-1])):
        raise bad
    if len(kf) and int(kf[-1] + kc[-1]) != total:
        raise bad


def parse_checksums(texts: Iterable[str], where: str) -> list[int]:
    """The chunk checksums of a version-1 index as integers (``xxh3_64:<16 hex>``)."""
    out = []
    for t in texts:
        hexpart = t.split(":", 1)[1]
        if len(hexpart) != 16:
            raise BadIndexError(f"{where}: checksum {t!r} is not 16 hex digits")
        out.append(int(hexpart, 16))
    return out
