"""Batches of every item shape users write: the batch path (forms learned from the item
headers in bulk, rows copied from the mapped chunks) gives what ``default_collate`` over
the decoded items gives, bit for bit: dtypes, shapes, bytes, and list / tuple types for
strings and bytes.

Two levels: a property over generated shapes (dicts, tuples, lists, nesting; numpy and
torch dtypes; Python and numpy scalars; str and bytes; values whose encoded width varies
from item to item), read straight from chunk files through :mod:`asynccache.read.batchread`
and :mod:`asynccache.torch.batches`; and the shapes of the benchmark matrix through
``CacheDataLoader`` with 0 and 2 workers, in order and shuffled, across chunk boundaries
and with a short last batch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, default_collate

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.format import ChunkView, build, decode, encode
from asynccache.read.batchread import FormCache, assemble_into, bytes_needed
from asynccache.read.reader import ChunkMap
from asynccache.torch import batches

# default_collate over items decoded from a read-only mapping (the per-item reference)
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


def same(a: Any, b: Any, where: str = "batch") -> None:
    """Bit-identical: same types (list vs tuple too), keys, dtypes, shapes and bytes."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        if a.numel():
            raw_a = a.contiguous().reshape(-1).view(torch.uint8)
            raw_b = b.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(raw_a, raw_b), where
    else:
        assert a == b, where


def same_item(a: Any, b: Any, where: str = "item") -> None:
    """Items equal as decode returns them: types (list vs tuple, numpy scalar vs Python),
    dtypes, shapes, bytes (NaN payloads too) and writability of arrays."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same_item(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_item(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape, a.flags.writeable) == (b.dtype, b.shape, b.flags.writeable)
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, (np.generic, float)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    else:
        assert a == b, where


# -- shapes ---------------------------------------------------------------------------------
# A shape is a tree: ("dict", keys, children) | ("list" / "tuple", children) | a leaf
# ("int" | "float" | "bool" | "str" | "bytes", spread) | ("array" / "tensor" / "npscalar",
# dtype, shape). Item i of a shape: its leaves filled from a generator seeded by i.
NP_DTYPES = [
    "|u1",
    "|i1",
    "<i2",
    "<u2",
    "<i4",
    "<u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    "<f8",
    "<c8",
    "|b1",
]
TORCH_DTYPES = ["uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "bool"]
SCALAR_DTYPES = ["|u1", "<i2", "<i4", "<i8", "<u4", "<f2", "<f4", "<f8", "|b1", "<c8"]


def leaves() -> st.SearchStrategy[Any]:
    small_shape = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
    return st.one_of(
        st.tuples(st.just("int"), st.sampled_from([1, 200, 70_000, 1 << 40, 1 << 62])),
        st.tuples(st.just("float"), st.just(0)),
        st.tuples(st.just("bool"), st.just(0)),
        st.tuples(st.just("str"), st.sampled_from([0, 8, 40, 300])),
        st.tuples(st.just("bytes"), st.sampled_from([0, 16, 3000])),
        st.tuples(st.just("array"), st.sampled_from(NP_DTYPES), small_shape),
        st.tuples(st.just("tensor"), st.sampled_from(TORCH_DTYPES), small_shape),
        st.tuples(st.just("npscalar"), st.sampled_from(SCALAR_DTYPES), st.just(())),
    )


def shapes() -> st.SearchStrategy[Any]:
    keys = st.text("abcxyz_", min_size=1, max_size=4)
    return st.recursive(
        leaves(),
        lambda inner: st.one_of(
            st.dictionaries(keys, inner, min_size=1, max_size=4).map(
                lambda d: ("dict", tuple(d), tuple(d.values()))
            ),
            st.tuples(st.sampled_from(["list", "tuple"]), st.lists(inner, min_size=1, max_size=3)),
        ),
        max_leaves=8,
    )


def fill(shape: Any, rng: np.random.Generator) -> Any:
    kind = shape[0]
    if kind == "dict":
        return {k: fill(c, rng) for k, c in zip(shape[1], shape[2], strict=True)}
    if kind in ("list", "tuple"):
        items = [fill(c, rng) for c in shape[1]]
        return items if kind == "list" else tuple(items)
    if kind == "int":  # signs and widths vary from item to item
        return int(rng.integers(-shape[1], shape[1] + 1))
    if kind == "float":
        return float(rng.choice([rng.normal() * 1e3, math.inf, -0.0, math.nan, 1e-310, 5e300]))
    if kind == "bool":
        return bool(rng.integers(2))
    if kind == "str":
        n = int(rng.integers(0, shape[1] + 1))
        alphabet = "ab/.-_0123456789é漢\u00a0"
        return "".join(alphabet[k] for k in rng.integers(0, len(alphabet), n))
    if kind == "bytes":
        return rng.bytes(int(rng.integers(0, shape[1] + 1)))
    dtype = shape[1]
    if kind == "tensor":
        values = np.array(rng.standard_normal(shape[2]) * 100, np.float32).reshape(shape[2])
        return torch.from_numpy(values).to(getattr(torch, dtype))
    dt = np.dtype(dtype)
    raw = np.frombuffer(rng.bytes(dt.itemsize * math.prod(shape[2])), np.uint8)
    if dt.kind == "b":
        arr = (raw & 1).astype(bool).reshape(shape[2])
    elif dt.kind == "f" or dt.kind == "c":
        arr = np.array(rng.standard_normal(shape[2]) * 50, dt).reshape(shape[2])
    else:
        arr = raw.view(dt).reshape(shape[2])
    return arr[()] if kind == "npscalar" else arr


def write_chunk(path: Path, items: list[Any]) -> ChunkMap:
    with open(path, "wb") as f:
        for piece in build(encode(x) for x in items):
            f.write(piece)
    return ChunkMap.open(str(path), os.path.getsize(path))


def offsets_of(mm: ChunkMap) -> np.ndarray:
    """The item offsets table of a mapped chunk (``count + 1`` values)."""
    view = ChunkView(mm, "c")
    return np.array([view.span(i)[0] for i in range(len(view))] + [len(mm)], np.int64)


def batch_path(
    cache: FormCache,
    chunks: list[tuple[ChunkMap, np.ndarray]],
    picks: list[tuple[int, int]],
    room: bool = False,
) -> Any:
    """The batch of items ``picks`` ((chunk, position) pairs) as the workers build it;
    None where they would collate it per item. ``room``: the buffer has room for the
    bytes values (they are copied into it and made ``bytes`` from it)."""
    n = len(picks)
    where = np.array([c for c, _ in picks])
    positions = np.array([p for _, p in picks])
    parts = []
    form = None
    for c in dict.fromkeys(where.tolist()):
        sel = np.flatnonzero(where == c)
        cf = cache.get(c, *chunks[c])
        f = cf.form_of(positions[sel])
        if f is None or (form is not None and f != form):
            return None
        form = f
        parts.append((cf, positions[sel], sel))
    assert form is not None
    if not batches.supported(form, objects=True):
        return None
    extra = bytes_needed(form, parts) if room else 0
    buf = batches.shared_bytes(form.regions(n)[1] + extra)
    objects = assemble_into(buf.numpy(), form, parts, n)
    return batches.wrap(form, buf, n, objects)


def per_item(chunks: list[tuple[ChunkMap, np.ndarray]], picks: list[tuple[int, int]]) -> Any:
    items = []
    for c, p in picks:
        mm, offsets = chunks[c]
        items.append(decode(mm, int(offsets[p]), int(offsets[p + 1]), where="test"))
    return default_collate(items)


def uniform(shape: Any) -> bool:
    """Every item of ``shape`` has one form (no leaf whose form varies by item)."""
    kind = shape[0]
    if kind == "dict":
        return all(uniform(c) for c in shape[2])
    if kind in ("list", "tuple"):
        return all(uniform(c) for c in shape[1])
    if kind == "npscalar":
        return np.dtype(shape[1]) != np.uint64
    return True


def has_tensor(shape: Any) -> bool:
    kind = shape[0]
    if kind == "dict":
        return any(has_tensor(c) for c in shape[2])
    if kind in ("list", "tuple"):
        return any(has_tensor(c) for c in shape[1])
    return kind == "tensor"


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    shape=shapes(),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    seed=st.integers(0, 2**31),
    batch=st.integers(1, 17),
)
@example(
    shape=("dict", ("image", "label"), (("array", "|u1", (40,)), ("int", 70_000))),
    sizes=[9, 4],
    seed=1,
    batch=5,
)
@example(shape=("str", 300), sizes=[30], seed=2, batch=7)
@example(shape=("tuple", [("str", 8), ("bytes", 16), ("int", 1)]), sizes=[5, 6], seed=3, batch=4)
def test_batches_of_any_shape_are_bit_identical(tmp_path_factory, shape, sizes, seed, batch):
    tmp = tmp_path_factory.mktemp("shapes")
    chunks = []
    k = 0
    for c, size in enumerate(sizes):
        items = [fill(shape, np.random.default_rng(seed + k + j)) for j in range(size)]
        k += size
        mm = write_chunk(tmp / f"c{c}.bin", items)
        chunks.append((mm, offsets_of(mm)))
    everything = [(c, p) for c, size in enumerate(sizes) for p in range(size)]
    order = np.random.default_rng(seed).permutation(len(everything))
    cache = FormCache(8, objects=True)
    # One chunk's mapping held at a time: a batch across chunks lets go of the first
    # chunk's while it still copies from it.
    narrow = FormCache(1, objects=True)
    assembled = 0
    # In order and shuffled, in batches of ``batch`` (the last one short): batches across
    # chunk boundaries, a chunk's first ask (its batch's items) and second (the rest).
    for picks_order in (np.arange(len(everything)), order):
        for a in range(0, len(everything), batch):
            picks = [everything[i] for i in picks_order[a : a + batch]]
            try:
                ref = per_item(chunks, picks)
            except (RuntimeError, TypeError):  # default_collate refuses it (uint64 scalars)
                continue
            got = batch_path(cache, chunks, picks)
            if got is None:
                assert not uniform(shape), f"a batch of {shape} was collated per item"
                continue
            assembled += 1
            same(got, ref)
            same(batch_path(cache, chunks, picks, room=True), ref)
            same(batch_path(narrow, chunks, picks), ref)
            # The per-item path's bulk decode: the items themselves, from the same tables.
            for c in dict.fromkeys(c for c, _ in picks):
                pos = np.array([p for cc, p in picks if cc == c])
                items = cache.get(c, *chunks[c]).items(pos)
                if items is None:
                    assert has_tensor(shape)
                    continue
                mm, offsets = chunks[c]
                for p, item in zip(pos.tolist(), items, strict=True):
                    same_item(item, decode(mm, int(offsets[p]), int(offsets[p + 1]), where="t"))
    assert assembled or not uniform(shape)


FUZZED = [
    ("dict", ("image", "label"), (("array", "|u1", (40,)), ("int", 70_000))),
    (
        "dict",
        ("x", "y", "w", "id"),
        (("array", "<f4", (4,)), ("int", 200), ("float", 0), ("str", 40)),
    ),
    ("tuple", [("str", 8), ("bytes", 16), ("int", 1), ("npscalar", "<f4", ())]),
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(FUZZED) - 1),
    seed=st.integers(0, 2**31),
    hits=st.lists(st.tuples(st.integers(0, 11), st.floats(0, 1), st.integers(0, 255)), max_size=3),
)
def test_corrupt_headers_are_never_misread(tmp_path_factory, which, seed, hits):
    """Bytes of some item headers changed: an item the batch path still assembles is one
    decode reads, to the same values; the others are left to the per-item path."""
    tmp = tmp_path_factory.mktemp("fuzz")
    items = [fill(FUZZED[which], np.random.default_rng(seed + j)) for j in range(12)]
    good = write_chunk(tmp / "good.bin", items)
    offsets = offsets_of(good)
    raw = bytearray(good[:])
    for p, where, value in hits:
        a = int(offsets[p])
        hlen = min(int.from_bytes(raw[a : a + 4], "little"), int(offsets[p + 1]) - a - 4)
        raw[a + int(where * (4 + hlen - 1))] = value
    (tmp / "bad.bin").write_bytes(bytes(raw))
    bad = ChunkMap.open(str(tmp / "bad.bin"), len(raw))
    chunks = [(bad, offsets)]
    cache = FormCache(2, objects=True)
    cache.get(0, *chunks[0]).form_of(np.arange(12))  # every header read at once
    for p in range(12):
        got = batch_path(cache, chunks, [(0, p)])
        if got is not None:
            same(got, per_item(chunks, [(0, p)]))


def test_items_of_different_forms_in_one_chunk(tmp_path):
    """Three forms alternating in a chunk (and headers that no template reads): each batch
    of one form is assembled, a batch mixing them is not."""
    items: list[Any] = []
    for i in range(30):
        if i % 3 == 0:
            items.append({"x": np.full(3, i, np.int32), "y": i * 1000})
        elif i % 3 == 1:
            items.append({"x": np.full(3, i, np.int32), "y": float(i)})
        else:
            items.append({"x": np.full(4, i, np.int32), "y": i, "n": None})
    mm = write_chunk(tmp_path / "c.bin", items)
    chunks = [(mm, offsets_of(mm))]
    cache = FormCache(4, objects=True)
    for first in (0, 1):
        picks = [(0, p) for p in range(first, 30, 3)]
        same(batch_path(cache, chunks, picks), per_item(chunks, picks))
    assert batch_path(cache, chunks, [(0, 2), (0, 5)]) is None  # (None leaves: no form)
    assert batch_path(cache, chunks, [(0, 0), (0, 1)]) is None  # int and float labels
    cf = cache.get(0, *chunks[0])
    assert sorted(set(cf.form_id.tolist())) == [-1, 0, 1]


def test_strings_without_objects_have_no_form(tmp_path):
    """A caller that can't carry lists (FormCache(objects=False)) gets no form for items
    with str / bytes leaves: it collates them, as before."""
    items = [{"x": np.arange(3), "id": f"item-{i}"} for i in range(10)]
    mm = write_chunk(tmp_path / "c.bin", items)
    offsets = offsets_of(mm)
    assert FormCache(1).get(0, mm, offsets).form_of(np.arange(10)) is None
    assert FormCache(1, objects=True).get(0, mm, offsets).form_of(np.arange(10)) is not None


def test_a_header_template_is_learned_once_per_dataset(tmp_path):
    """The second chunk of a dataset is read with the template the first one taught (no
    new template is cut), and its form is the same object."""
    cache = FormCache(4, objects=True)
    forms = []
    for c in range(2):
        items = [{"image": np.full(8, i, np.uint8), "label": i * 977} for i in range(50)]
        mm = write_chunk(tmp_path / f"c{c}.bin", items)
        cf = cache.get(c, mm, offsets_of(mm))
        forms.append(cf.form_of(np.arange(50)))
    assert forms[0] is forms[1] is not None
    assert len(cache.known) == 1


def test_chunks_of_many_shapes_are_learned_once_and_teach_no_template(tmp_path, monkeypatch):
    """Ragged arrays, each of its own length: a chunk's first ask cuts its few templates,
    finds the chunk is one of many shapes, and gives every item of it no form (no second
    ask reads the rest of its headers); a template that read one header alone is not kept,
    so the next chunk tries none of them in vain (before: two asks a chunk, each trying
    the 16 templates kept from earlier chunks, 0.14 of a worker's 0.53 s of an epoch).
    Items of two shapes keep their two templates, and their batches still have a form."""
    from asynccache.format import headers
    from asynccache.read import batchread

    matches: list[int] = []
    real = headers.match
    monkeypatch.setattr(headers, "match", lambda *a: matches.append(1) or real(*a))
    cache = FormCache(4, objects=True)
    for c in range(3):
        items = [np.arange(100 * c + i + 1, dtype=np.uint8) for i in range(40)]
        mm = write_chunk(tmp_path / f"r{c}.bin", items)
        cf = cache.get(c, mm, offsets_of(mm))
        before = len(matches)
        assert cf.form_of(np.arange(5, 21)) is None
        assert (cf.form_id != -2).all(), "the chunk's first ask settled every item"
        assert cf.form_of(np.arange(21, 37)) is None
        assert len(matches) - before <= batchread._NEW_TEMPLATES
        assert cache.known == [], "no template of one header is kept"
    chunks = []
    for c in range(2):
        items = [{"x": np.full(3 + i % 2, i, np.int32), "y": i} for i in range(40)]
        mm = write_chunk(tmp_path / f"two{c}.bin", items)
        chunks.append((mm, offsets_of(mm)))
        cf = cache.get(10 + c, *chunks[-1])
        assert cf.form_of(np.arange(0, 40, 2)) is not None
        assert cf.form_of(np.arange(1, 40, 2)) is not None
    assert len(cache.known) == 2
    picks = [(c, p) for c in range(2) for p in range(0, 40, 2)]
    same(batch_path(FormCache(2, objects=True), chunks, picks), per_item(chunks, picks))


def test_learning_a_chunk_reads_each_header_once(tmp_path, monkeypatch):
    """The headers of a chunk's large items (labels of every msgpack width) are read at
    most once each (from the file: no page of the chunk mapped for them), and one template
    is cut for all of them (the code before read every header again for each new one:
    1,066 reads for these 60 items)."""
    from asynccache.format import headers
    from asynccache.read import batchread

    items = [{"image": np.full(20 << 10, i, np.uint8), "label": i * 7919 - 300} for i in range(60)]
    mm = write_chunk(tmp_path / "c.bin", items)
    chunks = [(mm, offsets_of(mm))]
    reads, cuts = [], []
    real_pread, real_preadv, real_cut = os.pread, os.preadv, headers.compile_header
    with monkeypatch.context() as patch:
        patch.setattr(batchread.os, "pread", lambda *a: reads.append(a) or real_pread(*a))
        patch.setattr(batchread.os, "preadv", lambda *a: reads.append(a) or real_preadv(*a))
        patch.setattr(headers, "compile_header", lambda b: cuts.append(b) or real_cut(b))
        cf = FormCache(1).get(0, *chunks[0])
        for a in range(0, 60, 16):  # the first ask reads its batch's headers, the next the rest
            assert cf.form_of(np.arange(a, min(60, a + 16))) is not None
    assert len(reads) <= 60 and len(cuts) == 1
    assert (cf.form_id == 0).all()
    picks = [(0, p) for p in range(5, 60, 3)]
    same(batch_path(FormCache(1), chunks, picks), per_item(chunks, picks))


@pytest.mark.parametrize("large", [False, True])
def test_a_reader_of_part_of_a_chunk_reads_only_its_items_headers(tmp_path, large):
    """After a chunk's first ask, a reader that names the items it reads next (``ahead``:
    a worker's share of a shuffled window that other workers read too) learns those, not
    the whole chunk; without ``ahead``, every item at the second ask."""
    size = (20 << 10) if large else 8  # large: headers read from the file, else the mapping
    items = [{"image": np.full(size, i, np.uint8), "label": i} for i in range(64)]
    mm = write_chunk(tmp_path / "c.bin", items)
    offsets = offsets_of(mm)
    mine = np.arange(1, 64, 4)  # a quarter of the chunk, scattered
    cf = FormCache(1).get(0, mm, offsets)
    assert cf.form_of(mine[:4], ahead=mine) is not None
    assert (cf.form_id != -2).sum() == 4  # the first ask: its own
    assert cf.form_of(mine[4:8], ahead=mine) is not None
    assert np.flatnonzero(cf.form_id != -2).tolist() == mine.tolist()
    assert cf.form_of(mine[8:], ahead=mine) is not None  # nothing new to read
    assert np.flatnonzero(cf.form_id != -2).tolist() == mine.tolist()
    other = FormCache(1).get(0, mm, offsets)
    assert other.form_of(mine[:4]) is not None and other.form_of(mine[4:8]) is not None
    assert (other.form_id != -2).all()  # no ahead: the whole chunk at the second ask
    picks = [(0, int(p)) for p in mine[::-1]]
    same(batch_path(FormCache(1), [(mm, offsets)], picks), per_item([(mm, offsets)], picks))


def test_the_next_mapping_of_a_chunk_reads_no_header(tmp_path, monkeypatch):
    """A chunk's forms outlive its mapping (the next epoch maps it again): the new mapping
    of the same file takes them up, reading no header; a chunk published again (another
    file at the path) is read anew."""
    from asynccache.read import batchread

    path = tmp_path / "c.bin"
    items = [{"x": np.full(4, i, np.int16), "id": f"n{i}"} for i in range(40)]
    cache = FormCache(1, objects=True)
    first = write_chunk(path, items)
    cf = cache.get(0, first, offsets_of(first))
    assert cf.form_of(np.arange(8)) is not None and cf.form_of(np.arange(8, 40)) is not None
    assert len(cache) == 1
    cache.clear()  # the epoch ends: the mapping goes (cf, if still held, keeps its own)
    assert cf.buf is first and not cache
    reads: list[Any] = []
    real = batchread.headers.gather
    monkeypatch.setattr(batchread.headers, "gather", lambda *a: reads.append(a) or real(*a))
    again = ChunkMap.open(str(path), os.path.getsize(path))
    picks = [(0, p) for p in range(3, 40, 4)]
    chunks = [(again, offsets_of(again))]
    same(batch_path(cache, chunks, picks), per_item(chunks, picks))
    assert cache.get(0, *chunks[0]).form_id is cf.form_id and not reads
    cache.clear()
    os.unlink(path)  # published again: the same bytes in a new file
    renewed = write_chunk(path, items)
    assert cache.get(0, renewed, offsets_of(renewed)).form_id is not cf.form_id


# -- the benchmark's shapes through the loader -------------------------------------------------
N = 75  # items: 5 chunks of 16 (the last short), batches of 8 (the last short)
CHUNK = 16
BATCH = 8


def shape_item(name: str, i: int) -> Any:
    rng = np.random.default_rng(i)
    if name == "array":
        return rng.integers(0, 255, 64, np.uint8)
    if name == "image_label":
        return {"image": rng.integers(0, 255, (4, 4, 3), np.uint8), "label": i * 331}
    if name == "jpeg_label_path":
        return {"jpeg": rng.bytes(int(rng.integers(20, 400))), "label": i, "path": f"/d/{i}.jpg"}
    if name == "small_mixed":
        return {
            "x": rng.standard_normal(16).astype(np.float32),
            "y": i - 40,
            "w": i / 7,
            "id": f"s-{i}" * (1 + i % 3),
        }
    if name == "large":
        return rng.integers(0, 255, 20 << 10, np.uint8)  # rows copied from the file
    raise AssertionError(name)


SHAPES = ["array", "image_label", "jpeg_label_path", "small_mixed", "large"]


class Shaped(Dataset):
    def __init__(self, name: str) -> None:
        self.name = name

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return shape_item(self.name, i)


def collate_per_item(items: list[Any]) -> Any:
    """default_collate under another name: the loader reads and collates item by item."""
    return default_collate(items)


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name in SHAPES:
        path = tmp_path_factory.mktemp(name)
        list(CacheDataLoader(Shaped(name), cache_dir=path, chunk_size=CHUNK, batch_size=10))
        out[name] = path
    return out


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize(("workers", "shuffle"), [(0, False), (0, True), (2, False), (2, True)])
def test_the_shapes_through_the_loader(shaped, name, workers, shuffle):
    def epoch(**kw: Any) -> tuple[list[Any], StreamingDataset]:
        ds = StreamingDataset(shaped[name], shuffle=shuffle, seed=5)
        return list(CacheDataLoader(ds, batch_size=BATCH, num_workers=workers, **kw)), ds

    got, ds = epoch()
    ref, _ = epoch(collate_fn=collate_per_item)
    assert len(got) == len(ref) == -(-N // BATCH)
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    stats = ds.batch_stats()
    assert stats["assembled"] + stats["collated"] == len(got)
    assert stats["collated"] == 0  # every shape assembled by the workers


@pytest.mark.parametrize("name", ["image_label", "large"])
def test_a_rank_s_share_of_a_shuffled_window_reads_its_own_headers(shaped, name, monkeypatch):
    """A reader of a quarter of a shuffled epoch (rank 1 of 4; a worker sharing its window
    with others reads so too) learns the headers of the items it reads, not every item of
    the chunks it touches: each chunk's second ask read all of them, 4 readers each
    reading every header of a window (22,764 header reads for 5,242 items, 8 workers)."""
    from asynccache.read import batchread

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    learned: list[int] = []
    real = batchread.ChunkForms._read
    monkeypatch.setattr(
        batchread.ChunkForms,
        "_read",
        lambda self, todo, rows, lens: learned.append(len(todo)) or real(self, todo, rows, lens),
    )
    ds = StreamingDataset(shaped[name], shuffle=True, seed=5, shuffle_window=5)
    got = list(CacheDataLoader(ds, batch_size=BATCH, num_workers=0))
    mine = sum(len(b["label"] if isinstance(b, dict) else b) for b in got)
    assert mine == -(-N // 4) and ds.batch_stats()["collated"] == 0
    assert sum(learned) == mine, learned  # (before: every item of the 5 chunks, 75)
    ref = StreamingDataset(shaped[name], shuffle=True, seed=5, shuffle_window=5)
    per_item_batches = list(CacheDataLoader(ref, batch_size=BATCH, collate_fn=collate_per_item))
    for a, b in zip(got, per_item_batches, strict=True):
        same(a, b)


def test_items_one_by_one_hopping_between_chunks_are_built_once_per_chunk(shaped, monkeypatch):
    """A shuffled order hops between chunks at almost every item: the items of each chunk
    in a window are built in one call (a call per run of one item cost more than the
    item), handed out in the order asked, each equal to the item decoded alone."""
    from asynccache.read import batchread

    ds = StreamingDataset(shaped["jpeg_label_path"])
    ur = ds.unit_reader
    keys = np.array(
        [c * CHUNK + i for i in range(CHUNK) for c in range(4)]
    )  # 0, 16, 32, 48, 1, ...
    calls: list[int] = []
    real = batchread.ChunkForms.items
    monkeypatch.setattr(
        batchread.ChunkForms, "items", lambda self, p: calls.append(len(p)) or real(self, p)
    )
    got = ur.items(keys)
    assert calls == [CHUNK] * 4, calls
    chunks, positions = ds.index.locate_many(keys)
    assert [g["label"] for g in got] == keys.tolist()
    for k, g, c, p in zip(keys.tolist(), got, chunks.tolist(), positions.tolist(), strict=True):
        same_item(g, ur.reader.read(c, p), f"item {k}")
    # Each item's bytes are copied as the item is made, not all of the call's at once
    # (the copies of a window held together took fresh heap pages each time).
    copies: list[int] = []
    real_at = batchread.ChunkForms._bytes_at
    monkeypatch.setattr(
        batchread.ChunkForms,
        "_bytes_at",
        lambda self, o, n: copies.append(n) or real_at(self, o, n),
    )
    mm, offsets = ur.reader.item_mapping(0)
    it = batchread.FormCache(2, objects=True).get(0, mm, offsets).items(np.arange(CHUNK))
    assert it is not None and copies == []
    first = next(it)
    assert len(copies) == 1 and copies[0] == len(first["jpeg"])
    ds.close()


@pytest.mark.parametrize("name", SHAPES)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keys=st.lists(st.integers(0, N - 1), min_size=1, max_size=3 * N),
    window=st.integers(1, 2 * N),
)
def test_items_one_by_one_are_the_decoded_items_in_any_order_and_window(shaped, name, keys, window):
    """Any order of keys (repeats, chunk hops, runs) and any window: the items handed out
    one by one are, in order, the items decoded alone."""
    ds = StreamingDataset(shaped[name])
    ur = ds.unit_reader
    ur._window = window
    got = ur.items(np.array(keys))
    chunks, positions = ds.index.locate_many(np.array(keys))
    assert len(got) == len(keys)
    for k, g, c, p in zip(keys, got, chunks.tolist(), positions.tolist(), strict=True):
        same_item(g, ur.reader.read(c, p), f"item {k}")
    ds.close()
