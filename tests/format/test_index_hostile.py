"""Hostile ``index.json`` and sidecars: every mutation loads as a consistent index or is
refused with ``BadIndexError`` (``CorruptIndexError`` included) naming the file; nothing
else escapes, nothing allocates beyond a bound set by the input's size, nothing runs
past a generous CPU-time limit.

The mutations are re-sealed (and a mutated sidecar gets its trailer, name and size fixed
in ``index.json``) in most examples, so that they reach the validation behind the
checksums instead of stopping at them.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccache.errors import BadIndexError
from asynccache.format import Index
from asynccache.format import columns as cols_mod
from asynccache.format.index import (
    INDEX_CHECKSUM_FIELD,
    ChunkEntry,
    IndexMeta,
    check_filename,
    load,
    seal,
)

WHERE = "ds/index.json"
SIDE = "ds/side.cols"
CK = "xxh3_64:{:016x}"
#: CPU seconds one load may take: far above any real one (milliseconds), so never flaky.
CPU_LIMIT_S = 5.0
#: Allocation allowed per input byte, on top of a fixed allowance (json objects, arrays).
PER_BYTE, FIXED = 64, 4 << 20
#: Keys enumerated when checking a loaded index (more are sampled).
ENUMERATE = 1 << 16


# -- valid bases ---------------------------------------------------------------------------
def _bytes_for(items: int) -> int:
    """A plausible chunk size: header, offsets, item checksums, 64 bytes per item."""
    return 64 + 16 * (items + 1) + 64 * items


def _sequential() -> Index:
    chunks, first = [], 0
    for i, items in enumerate([3, 0, 5, 1, 4]):
        keys = ((first, items),) if items else ()
        chunks.append(ChunkEntry(f"chunk-0-{i}.bin", items, _bytes_for(items), CK.format(i), keys))
        first += items
    return Index(tuple(chunks), {"chunk_bytes": 4096, "writer": "test"})


def _scattered() -> Index:
    keys = [((3, 1), (0, 1)), ((1, 2),), (), ((4, 1), (5, 3))]
    items = [2, 2, 0, 4]
    names = ["a.bin", "b07.bin", "c\u00e9", "dd.x"]
    return Index(
        tuple(
            ChunkEntry(n, i, _bytes_for(i), CK.format(j), k, tokens=3 * i)
            for j, (n, i, k) in enumerate(zip(names, items, keys, strict=True))
        )
    )


def _per_writer() -> Index:
    chunks = tuple(
        ChunkEntry(f"chunk-1-{i}.bin", 2, _bytes_for(2), CK.format(i), ((10 + 2 * i, 2),))
        for i in range(3)
    )
    return Index(chunks, {}, writer=1, token="t0ken")


BASES = {"sequential": _sequential(), "scattered": _scattered(), "per-writer": _per_writer()}


def _v1(idx: Index) -> tuple[str, bytes]:
    return idx.to_json(), b""


def _v2(idx: Index) -> tuple[str, bytes]:
    _, data, text = idx.to_columns()
    return text, data


# -- mutation helpers ----------------------------------------------------------------------
HOSTILE: list[Any] = [
    0, 1, -1, 7, 2**31, 2**53 + 1, 10**10, 2**62, 2**63 - 1, 2**63, 2**64, 10**30,
    -(2**63), -(10**30), 0.5, 3.0, 1e300, math.inf, -math.inf, math.nan,
    True, False, None, "", "7", "x" * 300, "xxh3_64:0000000000000000", "../x", "a/b",
    [], {}, [0], [[0, 10**10]], [[0, 1], [0, 1]], [10**10, 10**10], {"a": 1},
    [[-1, 2]], [[0.5, 1]], [[True, True]], [["0", "1"]],
]  # fmt: skip


def _paths(node: Any, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield here
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*here, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*here, i))


def _mutate(doc: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    value = json.loads(json.dumps(value))  # a copy: the same object twice would be a cycle
    if not path:
        return value if op == "set" else doc
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if op == "set":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(last, json.loads(json.dumps(parent[last])))
    elif op == "duplicate":
        parent[f"{last}_"] = json.loads(json.dumps(parent[last]))
    return doc


def _sealed(doc: Any) -> str:
    """``doc`` as a writer would seal it (a root that is no object, or an empty one, can't
    carry a seal: its body has no closing brace on a line of its own)."""
    if not isinstance(doc, dict):
        return json.dumps(doc)
    doc = {k: v for k, v in doc.items() if k != INDEX_CHECKSUM_FIELD}
    if not doc:
        return json.dumps(doc)
    return seal(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _point_at(text: str, sidecar: bytes) -> str:
    """``text`` (a version-2 index.json) naming ``sidecar`` by its digest and size."""
    doc = json.loads(text)
    if isinstance(doc, dict) and isinstance(doc.get("columns"), dict):
        hexd = cols_mod.digest(sidecar)
        doc["columns"].update(
            filename=cols_mod.sidecar_name(hexd), bytes=len(sidecar), checksum=f"xxh3_64:{hexd}"
        )
    return _sealed(doc)


def _with_trailer(data: bytearray) -> bytes:
    if len(data) >= 8:
        import xxhash

        struct.pack_into("<Q", data, len(data) - 8, xxhash.xxh3_64_intdigest(bytes(data[:-8])))
    return bytes(data)


# -- the oracle ----------------------------------------------------------------------------
class _CpuLimit(Exception):
    pass


@contextlib.contextmanager
def _cpu_limit(seconds: float) -> Iterator[None]:
    """Raise _CpuLimit once this process has used ``seconds`` of CPU (not wall) time.

    SIGVTALRM, not SIGALRM: pytest-timeout owns the latter."""

    def fire(signum: int, frame: Any) -> None:
        raise _CpuLimit

    old = signal.signal(signal.SIGVTALRM, fire)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, old)


def _load(text: str, sidecar: bytes) -> Index:
    got = load(text, WHERE)
    if isinstance(got, IndexMeta):
        got = got.open(sidecar, SIDE)
    return got


def _consistent(idx: Index) -> None:
    """What every loaded index must satisfy (work bounded by its chunk count)."""
    n = idx.num_chunks
    items = [int(x) for x in idx.items_per_chunk]
    sizes = [int(x) for x in idx.bytes_per_chunk]
    assert len(items) == len(sizes) == n
    assert all(i >= 0 and 8 * i <= s < 2**63 for i, s in zip(items, sizes, strict=True))
    start = [int(x) for x in idx.item_start]
    assert start[0] == 0 and all(
        b - a == i for a, b, i in zip(start[:-1], start[1:], items, strict=True)
    )
    assert idx.total_items == sum(items) < 2**62
    assert idx.total_bytes == sum(sizes) < 2**63
    names = [idx.filename(c) for c in range(n)]
    for name in names:
        assert check_filename(name, "x") == name
    assert len(set(names)) == n
    entries = list(idx.chunks)
    assert [e.items for e in entries] == items and [e.filename for e in entries] == names
    if idx.tokens_per_chunk is not None:
        assert all(int(t) >= 0 for t in idx.tokens_per_chunk)
    assert idx.writer is None or (type(idx.writer) is int and idx.writer >= 0)
    assert idx.token is None or isinstance(idx.token, str)
    assert isinstance(idx.config, dict)
    if idx.writer is not None or not idx.total_items:
        return
    total = idx.total_items
    keys = (
        np.arange(total, dtype=np.int64)
        if total <= ENUMERATE
        else np.asarray([0, 1, total // 2, total - 2, total - 1], dtype=np.int64)
    )
    chunk, pos = idx.locate_many(keys)
    assert ((chunk >= 0) & (chunk < n)).all()
    assert ((pos >= 0) & (pos < np.asarray(items, dtype=np.int64)[chunk])).all()
    if total <= ENUMERATE:  # every (chunk, position) once: the keys are a bijection
        assert len(set(zip(chunk.tolist(), pos.tolist(), strict=True))) == total
        for c in range(n):
            got = idx.chunk_keys(c)
            assert len(got) == items[c]
            np.testing.assert_array_equal(idx.locate_many(got)[0], np.full(len(got), c))


def check(text: str, sidecar: bytes) -> Index | None:
    """Load under the CPU and allocation bounds: the index, or None when refused."""
    bound = FIXED + PER_BYTE * (len(text) + len(sidecar))
    tracemalloc.start()
    try:
        with _cpu_limit(CPU_LIMIT_S):
            try:
                idx = _load(text, sidecar)
            except BadIndexError as exc:
                assert WHERE in str(exc) or SIDE in str(exc), exc
                idx = None
            except _CpuLimit:
                pytest.fail(f"loading took over {CPU_LIMIT_S}s of CPU")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= bound, f"loading allocated {peak} bytes, bound {bound}"
    if idx is not None:
        with _cpu_limit(CPU_LIMIT_S):
            _consistent(idx)
    return idx


# -- explicit cases ----------------------------------------------------------------------
def _v1_doc(items: Any, size: Any = 9472, keys: Any = None) -> str:
    chunk = {"filename": "chunk-0-0.bin", "items": items, "bytes": size,
             "checksum": CK.format(1), "keys": keys if keys is not None else [[0, items]]}  # fmt: skip
    doc = {"format": "asynccache-index", "version": 1, "chunks": [chunk],
           "total_items": items, "total_bytes": size, "config": {}}  # fmt: skip
    return _sealed(doc)


def test_ten_billion_items_in_a_small_chunk_are_refused_naming_the_field() -> None:
    with pytest.raises(BadIndexError, match=r"ds/index.json: .*chunks\[0\].*items"):
        load(_v1_doc(10**10), WHERE)


@pytest.mark.parametrize(
    "items, size",
    [(-1, 100), (True, 100), (2.0, 100), ("2", 100), (2**64, 2**70), (1, 2**63), (1, -5)],
)
def test_counts_must_be_real_bounded_integers(items, size) -> None:
    with pytest.raises(BadIndexError, match=r"ds/index.json: .*chunks\[0\]"):
        load(_v1_doc(items, size, keys=[[0, 1]]), WHERE)


@pytest.mark.parametrize("keys", [[[0.5, 1]], [[True, 1]], [["0", 1]], [[0, 1, 2]], [[-1, 2]], 7])
def test_key_runs_must_be_pairs_of_integers(keys) -> None:
    with pytest.raises(BadIndexError, match=r"ds/index.json: .*chunks\[0\]\.keys"):
        load(_v1_doc(1, 9472, keys=keys), WHERE)


def test_a_sidecar_claiming_ten_billion_items_is_refused() -> None:
    text, data = _v2(_sequential())
    c = cols_mod.decode(data, SIDE, chunks=5, parts=("chunk-", "-", ".bin"))
    items = np.array(c.items)
    items[0] += 10**10
    fake = cols_mod.from_lists(
        items.tolist(),
        c.bytes.tolist(),
        [f"chunk-0-{i}.bin" for i in range(5)],
        [((0, int(items[0])),), (), ((int(items[0]), 5),), ((int(items[0]) + 5, 1),),
         ((int(items[0]) + 6, 4),)],
        checksums=c.checksums.tolist(),
    )  # fmt: skip
    data = cols_mod.encode(fake)
    doc = json.loads(text)
    doc["total_items"] += 10**10
    doc["total_bytes"] = 10**12  # index.json stays plausible: the sidecar must be caught
    text = _point_at(_sealed(doc), data)
    with pytest.raises(BadIndexError, match=f"{SIDE}: chunk 0 items: 10000000003 items"):
        _load(text, data)
    assert check(text, data) is None


@pytest.mark.parametrize("field", ["chunks", "total_items", "total_bytes"])
@pytest.mark.parametrize("value", [10**10, 2**64, -1, True, 2.5, "3"])
def test_version_2_counts_are_refused_naming_the_field(field, value) -> None:
    text, sidecar = _v2(_sequential())
    doc = json.loads(text)
    doc[field] = value
    with pytest.raises(BadIndexError, match=f"{WHERE}: .*{field}"):
        _load(_sealed(doc), sidecar)


def test_version_2_config_of_the_wrong_type_is_refused() -> None:
    text, _ = _v2(_sequential())
    doc = json.loads(text)
    doc["config"] = "ab"
    with pytest.raises(BadIndexError, match=f"{WHERE}: .*config"):
        load(_sealed(doc), WHERE)


def _sidecar_index(cols: cols_mod.Columns, parts: list[str] | None) -> tuple[str, bytes]:
    """A version-2 ``index.json`` (sealed) naming the sidecar of ``cols`` as they are."""
    data = cols_mod.encode(cols)
    doc = {"format": "asynccache-index", "version": 2, "chunks": len(cols),
           "columns": {}, "names": {"pattern": parts}, "config": {},
           "total_items": int(cols.item_start[-1]),
           "total_bytes": int(cols.bytes.sum())}  # fmt: skip
    return _point_at(_sealed(doc), data), data


@pytest.mark.parametrize(
    "names", [["chunk-2147483648-1.bin"] * 2, ["chunk-7-1-2-3.bin"] * 2, ["data.bin"] * 2]
)
def test_repeated_pattern_names_are_refused_whatever_their_numbers(names) -> None:
    cols = cols_mod.from_lists([1, 1], [512, 512], names, [((0, 1),), ((1, 1),)], [1, 2])
    assert isinstance(cols.names, cols_mod.PatternNames)
    text, data = _sidecar_index(cols, list(cols.names.parts))
    with pytest.raises(BadIndexError, match=f"{SIDE}: a chunk filename appears twice"):
        _load(text, data)


def test_an_unsafe_name_that_is_not_utf8_is_refused_naming_it() -> None:
    import dataclasses

    cols = cols_mod.from_lists([1, 1], [512, 512], ["a.bin", "b"], [((0, 1),), ((1, 1),)], [1, 2])
    blob = np.frombuffer(b"a.bin\xff/", np.uint8)
    names = cols_mod.TableNames(np.array([0, 5, 7], np.int64), blob)
    text, data = _sidecar_index(dataclasses.replace(cols, names=names), None)
    with pytest.raises(BadIndexError, match=f"{SIDE}: chunk filename .* points outside"):
        _load(text, data)


def test_item_counts_whose_starts_wrap_past_int64_are_refused() -> None:
    import dataclasses

    huge = 1 << 62  # four of them wrap int64 back to 0: item_start ends at 0 items
    cols = cols_mod.from_lists([1] * 4, [512] * 4, [f"c{i}.bin" for i in range(4)],
                               [((i, 1),) for i in range(4)], [1, 2, 3, 4])  # fmt: skip
    items = np.full(4, huge, np.int64)
    with np.errstate(over="ignore"):
        start = np.concatenate([[0], np.cumsum(items)]).astype(np.int64)
    assert start[-1] == 0
    cols = dataclasses.replace(cols, items=items, item_start=start)
    text, data = _sidecar_index(cols, list(cols.names.parts))
    with pytest.raises(BadIndexError, match=SIDE):
        _load(text, data)


# Per-writer indexes are only ever written in version 1 (their keys don't start at 0).
FORMS = [(n, _v1) for n in sorted(BASES)] + [(n, _v2) for n in sorted(BASES) if n != "per-writer"]


@pytest.mark.parametrize("name, form", FORMS)
def test_the_bases_load_and_are_consistent(name, form) -> None:
    text, data = form(BASES[name])
    idx = check(text, data)
    assert idx is not None and idx.total_items == BASES[name].total_items


# -- properties --------------------------------------------------------------------------
_OPS = st.sampled_from(["set", "set", "set", "delete", "duplicate"])
_VALUES = st.one_of(
    st.sampled_from(HOSTILE),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_PROFILE = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


_WORDS = st.one_of(
    st.sampled_from([0, 1, 2**31, 2**32, 10**10, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 8]),
    st.integers(0, 2**64 - 1),
)
#: Mostly re-sealed / trailer fixed, so that the mutation reaches what the seal guards.
_FIXED = st.sampled_from([True, True, True, False])


def _column_words(sidecar: bytes) -> list[tuple[str, int, int]]:
    """``(column, offset, count)`` of each 8-byte column in the sidecar's directory."""
    _, _, ncols, _, _ = struct.unpack_from("<8sIIQQ32x", sidecar, 0)
    out = []
    for i in range(ncols):
        name, dt, off, count = struct.unpack_from("<16s8sQQ8x", sidecar, 64 + 48 * i)
        if dt.rstrip(b"\0") in (b"<i8", b"<u8") and count:
            out.append((name.rstrip(b"\0").decode(), off, count))
    return out


@_PROFILE
@given(base=st.sampled_from(FORMS), data=st.data(), reseal=_FIXED)
def test_mutated_index_json_loads_consistently_or_is_refused(base, data, reseal) -> None:
    name, form = base
    text, sidecar = form(BASES[name])
    doc = json.loads(text)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = list(_paths(doc))
        path = data.draw(st.sampled_from(paths), label="path")
        op = data.draw(_OPS, label="op")
        doc = _mutate(doc, path, op, data.draw(_VALUES, label="value"))
    if reseal:
        mutated = _sealed(doc)
    else:  # an unsealed index (older writers, hand-made): read unverified
        if isinstance(doc, dict):
            doc.pop(INDEX_CHECKSUM_FIELD, None)
        mutated = json.dumps(doc)
    check(mutated, sidecar)


@_PROFILE
@given(base=st.sampled_from(["scattered", "sequential"]), data=st.data(), fix_trailer=_FIXED)
def test_mutated_sidecar_loads_consistently_or_is_refused(base, data, fix_trailer) -> None:
    text, sidecar = _v2(BASES[base])
    columns = _column_words(sidecar)
    buf = bytearray(sidecar)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        kind = data.draw(
            st.sampled_from(["value", "value", "value", "word", "byte", "truncate", "extend"])
        )
        if kind == "value":  # one number of one column
            _, off, count = data.draw(st.sampled_from(columns), label="column")
            at = off + 8 * data.draw(st.integers(0, count - 1), label="element")
            if at + 8 <= len(buf):
                struct.pack_into("<Q", buf, at, data.draw(_WORDS, label="value"))
        elif kind == "word" and len(buf) >= 16:  # anywhere: header, directory, padding
            at = data.draw(st.integers(0, len(buf) // 8 - 2), label="word") * 8
            struct.pack_into("<Q", buf, at, data.draw(_WORDS, label="value"))
        elif kind == "byte" and buf:
            at = data.draw(st.integers(0, len(buf) - 1), label="byte")
            buf[at] = data.draw(st.integers(0, 255), label="to")
        elif kind == "truncate":
            del buf[data.draw(st.integers(0, len(buf)), label="keep") :]
        elif kind == "extend":
            buf += bytes(data.draw(st.sampled_from([8, 64, 4096]), label="grow"))
    mutated = _with_trailer(buf) if fix_trailer else bytes(buf)
    check(_point_at(text, mutated), mutated)
