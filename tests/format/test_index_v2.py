"""Index version 2: the per-chunk facts as a mapped, checksummed column sidecar."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from asynccache.cache.indexfile import read_dir, write_dir
from asynccache.errors import BadIndexError, CorruptIndexError, UnsafePathError
from asynccache.format import ChunkEntry, Index
from asynccache.format.columns import from_lists
from asynccache.format.index import INDEX_CHECKSUM_FIELD, IndexMeta, load, seal

CK = "xxh3_64:{:016x}"


def _sequential(n: int = 7) -> Index:
    chunks, first = [], 0
    for i in range(n):
        items = (i * 5) % 4  # some empty chunks too
        chunks.append(
            ChunkEntry(f"chunk-3-{i}.bin", items, 100 + i, CK.format(i * 977), ((first, items),))
        )
        first += items
    return Index(tuple(c if c.items else ChunkEntry(c.filename, 0, c.bytes, c.checksum, ())
                       for c in chunks))  # fmt: skip


def _scattered() -> Index:
    """Keys in several runs per chunk, names following no pattern, token counts."""
    keys = [((3, 1), (0, 1)), ((1, 2),), (), ((4, 1), (5, 3))]
    items = [2, 2, 0, 4]
    names = ["a.bin", "b07.bin", "c", "dd.x"]
    return Index(
        tuple(
            ChunkEntry(n, i, 10 * i + 1, CK.format(j), k, tokens=3 * i)
            for j, (n, i, k) in enumerate(zip(names, items, keys, strict=True))
        )
    )


def _v2(idx: Index) -> tuple[Index, bytes, str]:
    _, data, text = idx.to_columns()
    meta = load(text, "ds/index.json")
    assert isinstance(meta, IndexMeta)
    return meta.open(data, "ds/" + meta.sidecar), data, text


@pytest.mark.parametrize("make", [_sequential, _scattered])
def test_both_forms_hold_the_same_index(make) -> None:
    v1 = Index.from_json(make().to_json(), "ds/index.json")
    v2, _, _ = _v2(v1)
    assert v2.mapped and not v1.mapped
    assert list(v2.chunks) == list(v1.chunks)
    assert v2.total_items == v1.total_items and v2.total_bytes == v1.total_bytes
    keys = np.arange(v1.total_items)
    for a, b in zip(v1.locate_many(keys), v2.locate_many(keys), strict=True):
        np.testing.assert_array_equal(a, b)
    for ci in range(len(v1.chunks)):
        np.testing.assert_array_equal(v1.chunk_keys(ci), v2.chunk_keys(ci))
        assert v2.chunk_number(v2.filename(ci)) == ci
    assert v2.chunk_number("nope.bin") is None
    if v1.tokens_per_chunk is not None:
        np.testing.assert_array_equal(v1.tokens_per_chunk, v2.tokens_per_chunk)
    # The identity is the sidecar's checksum (not a serialisation of every chunk).
    assert v2.checksum == json.loads(_v2(v1)[2])["columns"]["checksum"]


def test_pattern_names_store_numbers_not_strings() -> None:
    _, data, text = _sequential(1000).to_columns()
    assert json.loads(text)["names"]["pattern"] == ["chunk-", "-", ".bin"]
    assert len(text) < 600  # index.json does not grow with the chunks
    assert len(data) < 1000 * 6 * 8 + 2048  # six int64 columns and a header


def test_every_byte_flip_of_the_sidecar_is_refused_naming_it() -> None:
    _, data, text = _scattered().to_columns()
    meta = load(text, "ds/index.json")
    assert isinstance(meta, IndexMeta)
    for pos in range(0, len(data), 7):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptIndexError, match="ds/side.cols"):
            meta.open(bytes(bad), "ds/side.cols")
    with pytest.raises(CorruptIndexError, match="ds/side.cols"):
        meta.open(data[:-1], "ds/side.cols")  # truncated


def test_every_byte_flip_of_a_v2_index_json_is_caught() -> None:
    _, data, text = _sequential().to_columns()
    raw = text.encode()
    for pos in range(len(raw)):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        try:
            meta = load(bytes(bad), "ds/index.json")
            meta.open(data) if isinstance(meta, IndexMeta) else None
        except BadIndexError as exc:
            assert "ds/index.json" in str(exc) or "index-" in str(exc)
            continue
        assert bytes(bad).strip() == raw.strip() or bad.decode().split() == text.split()


def _resealed(text: str, edit) -> str:
    doc = json.loads(text)
    del doc[INDEX_CHECKSUM_FIELD]
    edit(doc)
    return seal(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def test_lengths_that_disagree_are_refused() -> None:
    _, data, text = _sequential().to_columns()

    def more_chunks(doc):
        doc["chunks"] += 1

    def more_items(doc):
        doc["total_items"] += 1

    meta = load(_resealed(text, more_chunks), "ds/index.json")
    assert isinstance(meta, IndexMeta)
    with pytest.raises(BadIndexError, match="chunks, index.json says"):
        meta.open(data)
    meta = load(_resealed(text, more_items), "ds/index.json")
    assert isinstance(meta, IndexMeta)
    with pytest.raises(BadIndexError, match="ds/index.json: total_items"):
        meta.open(data)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["columns"].update(filename="../index-0000000000000000.cols"),
        lambda d: d["names"].update(pattern=["../chunk-", ".bin"]),
        lambda d: d["names"].update(pattern=["/etc/x", ""]),
    ],
)
def test_unsafe_names_in_index_json_are_refused(edit) -> None:
    _, _, text = _sequential().to_columns()
    with pytest.raises(UnsafePathError, match="ds/index.json"):
        load(_resealed(text, edit), "ds/index.json")


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "c:d"])
def test_unsafe_names_in_the_sidecar_are_refused(bad) -> None:
    c = from_lists([1, 1], [64, 64], ["ok.bin", bad], [((0, 1),), ((1, 1),)], checksums=[1, 2])
    idx = Index(Index(()).chunks)  # an empty index, to borrow its writer
    object.__setattr__(idx, "_cols", c)
    stand_in = [ChunkEntry(f"x{i}", 1, 64, CK.format(1), ((i, 1),)) for i in range(2)]
    object.__setattr__(idx, "chunks", stand_in)
    _, data, text = idx.to_columns()
    meta = load(text, "ds/index.json")
    assert isinstance(meta, IndexMeta)
    with pytest.raises(BadIndexError, match="ds/side.cols: .*(outside|'\\.' or)"):
        meta.open(data, "ds/side.cols")


def test_written_dataset_is_version_2_and_old_sidecars_go(tmp_path) -> None:
    d = str(tmp_path)
    first = write_dir(d, _sequential())
    second = write_dir(d, _scattered())
    assert json.loads((tmp_path / "index.json").read_text())["version"] == 2
    side = [n for n in os.listdir(d) if n.endswith(".cols")]
    assert side == [f"index-{second.checksum[8:]}.cols"] != [f"index-{first.checksum[8:]}.cols"]
    again = read_dir(d)
    assert again.mapped and list(again.chunks) == list(_scattered().chunks)
    # the mapping is read-only: nothing can scribble on the node's shared pages
    with pytest.raises(ValueError):
        again.items_per_chunk[0] = 5


def test_names_with_several_numbers_are_looked_up_by_array() -> None:
    names = [f"chunk-51e7a-{s}-{n}.bin" for s in range(3) for n in range(40)]  # optimize's
    c = from_lists([1] * 120, [1] * 120, names, [((i, 1),) for i in range(120)], list(range(120)))
    assert c.names.parts == ("chunk-", "e", "a-", "-", ".bin")  # type: ignore[union-attr]
    assert [c.names.number(n) for n in names] == list(range(120))
    assert c.names.number("chunk-51e7a-3-0.bin") is None
    assert c.names.number("chunk-51e7a-0-07.bin") is None  # not written that way
