"""Chunk format version 2: each item's checksum in the chunk header, the header's
checksum in the index (per-writer JSON, the merged index's column sidecar), so items read
by range can be verified on arrival. Version-1 chunks and indexes without header
checksums still read."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache import BadIndexError, TruncatedChunkError, UnsupportedVersionError, optimize
from asynccache.cache.indexfile import read_dir
from asynccache.config import Settings
from asynccache.format import ChunkView, Index, build, decode, encode
from asynccache.format.chunk import header_offsets, items_start, parse_header
from asynccache.format.tokens import flags_for
from asynccache.read.reader import Reader
from asynccache.write.writer import ChunkWriter, merge_dir, read_index
from tests.format.old_layout import write_v1_dataset
from tests.optimize import helpers

leaves = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.binary(max_size=300),
    st.text(max_size=40),
    st.builds(lambda n: np.arange(n, dtype=np.int16), st.integers(0, 200)),
)


def _chunk_bytes(items: list[object], flags: int = 0) -> tuple[bytes, str | None]:
    chunk = build([encode(x) for x in items], flags)
    return b"".join(bytes(p) for p in chunk), chunk.head


def _check_chunk(data: bytes, head: str | None, n: int) -> None:
    """``data`` is a version-2 chunk of ``n`` items whose header hashes to ``head`` and
    whose item checksums are each item's bytes' xxh3_64."""
    view = ChunkView(data, "mem")
    assert view.version == 2 and len(view) == n
    hlen = items_start(n)
    assert head == f"xxh3_64:{xxhash.xxh3_64_hexdigest(data[:hlen])}"
    sums_view = view.item_checksums(data)
    assert sums_view is not None
    offsets, sums = parse_header(data[:hlen], n, len(data), "mem")
    assert np.array_equal(offsets, header_offsets(data[:hlen], n, len(data), "mem"))
    for p in range(n):
        a, b = view.span(p)
        assert (int(offsets[p]), int(offsets[p + 1])) == (a, b)
        assert int(sums[p]) == int(sums_view[p]) == xxhash.xxh3_64_intdigest(data[a:b])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(leaves, max_size=4), max_size=12))
def test_every_item_checksum_and_the_header_checksum_match_the_bytes(items):
    data, head = _chunk_bytes(items)
    _check_chunk(data, head, len(items))
    view = ChunkView(data, "mem")
    for p, x in enumerate(items):
        got = decode(data, *view.span(p), where="mem")
        assert len(got) == len(x)


def test_a_token_chunk_stays_version_1_without_checksums():
    docs = [[np.arange(n, dtype=np.uint16)] for n in (3, 0, 7)]
    chunk = build(docs, flags_for(np.dtype("uint16")))
    data = b"".join(bytes(p) for p in chunk)
    view = ChunkView(data, "tokens")
    assert chunk.head is None and view.version == 1 and view.item_checksums(data) is None
    assert view.tokens == 10


def test_a_damaged_header_or_an_index_that_disagrees_is_refused():
    data, _ = _chunk_bytes([{"a": 1}, {"b": b"x" * 100}])
    hlen = items_start(2)
    with pytest.raises(TruncatedChunkError, match="can't hold the header"):
        parse_header(data[: hlen - 8], 2, len(data), "mem")
    with pytest.raises(TruncatedChunkError, match="does not match the index"):
        parse_header(data[:hlen], 2, len(data) + 64, "mem")  # the index says another size
    old = bytearray(data[:hlen])
    old[8] = 1  # version 1: no item checksums to verify items against
    with pytest.raises(UnsupportedVersionError, match="no item checksums"):
        parse_header(bytes(old), 2, len(data), "mem")


def _writer_dataset(directory: Path, shuffled: bool = False) -> Index:
    keys = list(range(40))
    if shuffled:
        random.Random(3).shuffle(keys)
    writers = [ChunkWriter(str(directory), w, chunk_size=6) for w in range(2)]
    for j, k in enumerate(keys):
        writers[j % 2 if shuffled else k // 20].add(k, {"k": k, "x": np.full(k, k)})
    for w in writers:
        w.finish()
    return merge_dir(str(directory), [0, 1], renumber=False)


def _check_dir(directory: Path, idx: Index) -> None:
    assert idx.head_checksums is not None and len(idx.head_checksums) == idx.num_chunks
    for ci, entry in enumerate(idx.chunks):
        data = (directory / entry.filename).read_bytes()
        _check_chunk(data, entry.head, entry.items)
        assert int(idx.head_checksums[ci]) == int(entry.head.split(":")[1], 16)


def test_writers_record_header_checksums_and_the_merge_keeps_them(tmp_path):
    idx = _writer_dataset(tmp_path)
    assert idx.mapped  # version 2: the column sidecar
    _check_dir(tmp_path, idx)
    # Each writer's own (version-1) index carries them per chunk entry.
    doc = json.loads((tmp_path / "0.index.json").read_text())
    assert all(c["head"].startswith("xxh3_64:") for c in doc["chunks"])
    # Both index versions read back the same checksums.
    again = read_dir(str(tmp_path))
    assert np.array_equal(again.head_checksums, idx.head_checksums)
    v1 = Index.from_json(Index(tuple(idx.chunks), dict(idx.config)).to_json(), "v1")
    assert np.array_equal(v1.head_checksums, idx.head_checksums)


def test_chunks_rewritten_in_key_order_get_their_own_header_checksums(tmp_path):
    idx = _writer_dataset(tmp_path, shuffled=True)
    assert all(c.filename.startswith("chunk-999999999-") for c in idx.chunks)  # compacted
    _check_dir(tmp_path, idx)


def test_optimize_records_header_checksums(tmp_path):
    out = tmp_path / "out"
    quiet = Settings.from_env(progress=False)
    optimize(
        helpers.items, list(range(30)), str(out), num_workers=0, chunk_bytes="1KB", settings=quiet
    )
    _check_dir(out, read_dir(str(out)))


def test_a_header_checksum_that_is_not_one_is_refused(tmp_path):
    idx = _writer_dataset(tmp_path)
    doc = json.loads(Index(tuple(idx.chunks), dict(idx.config)).to_json())
    doc.pop("index_checksum")
    doc["chunks"][0]["head"] = "xxh3_64:nothex"
    with pytest.raises(BadIndexError, match="head"):
        Index.from_json(json.dumps(doc), "edited")


@pytest.mark.parametrize("columns", [True, False], ids=["index-v2", "index-v1"])
def test_a_dataset_of_the_previous_format_still_reads(tmp_path, columns):
    src = write_v1_dataset(tmp_path / "old", 20, 6, lambda i: {"i": i}, columns=columns)
    idx = read_index(os.path.join(src, "index.json"))
    assert idx.head_checksums is None
    data = (src / idx.filename(0)).read_bytes()
    view = ChunkView(data, "old")
    assert view.version == 1 and view.item_checksums(data) is None
    reader = Reader(idx, lambda ci, e: str(src / e.filename))
    assert [reader[i]["i"] for i in range(20)] == list(range(20))
    reader.close()
