"""Bad files raise specific errors naming the file, never a crash or a wrong item."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from asynccache.cache.indexfile import read_path
from asynccache.errors import (
    AsyncCacheError,
    BadIndexError,
    BadMagicError,
    ChecksumMismatchError,
    ObjectNotFoundError,
    TruncatedChunkError,
    UnsafePathError,
    UnsupportedVersionError,
)
from asynccache.format import Index, checksum
from asynccache.format.index import INDEX_CHECKSUM_FIELD
from asynccache.torch.cache import Cache


@pytest.fixture
def written(tmp_path):
    cache = Cache(tmp_path, chunk_size=4)
    for i in range(10):
        cache[i] = {"x": np.full(8, i, dtype=np.int32), "i": i}
    cache.done()
    return tmp_path


def load_unsealed(path):
    """The index as a version-1 dict, without its ``index_checksum``: edited by hand, it is
    unsealed (a version-2 index is turned into its version-1 form first)."""
    doc = json.loads(read_path(str(path)).to_json())
    doc.pop(INDEX_CHECKSUM_FIELD)
    return doc


def rewrite_chunk(directory, mutate, *, fix_index=True):
    """Apply ``mutate`` to chunk-0-0.bin; optionally make the index agree (size, checksum)."""
    path = os.path.join(directory, "chunk-0-0.bin")
    data = bytearray(open(path, "rb").read())
    data = mutate(data)
    open(path, "wb").write(data)
    if fix_index:
        idx_path = os.path.join(directory, "index.json")
        doc = load_unsealed(idx_path)
        doc["chunks"][0]["bytes"] = len(data)
        doc["chunks"][0]["checksum"] = checksum(bytes(data))
        doc["total_bytes"] = sum(c["bytes"] for c in doc["chunks"])
        json.dump(doc, open(idx_path, "w"))
    return path


def read_first(directory):
    return Cache(directory)[0]


def test_written_reads_back(written):
    assert Cache(written)[5]["i"] == 5


def test_bad_magic(written):
    def mutate(d):
        d[:8] = b"NOTACHNK"
        return d

    path = rewrite_chunk(written, mutate)
    with pytest.raises(BadMagicError, match="chunk-0-0.bin"):
        read_first(written)
    assert path


def test_unknown_version(written):
    def mutate(d):
        d[8:12] = struct.pack("<I", 99)
        return d

    rewrite_chunk(written, mutate)
    with pytest.raises(UnsupportedVersionError, match=r"chunk-0-0.bin.*version 99"):
        read_first(written)


def test_truncated_chunk_detected_against_index(written):
    rewrite_chunk(written, lambda d: d[: len(d) // 2], fix_index=False)
    with pytest.raises(TruncatedChunkError, match="chunk-0-0.bin"):
        read_first(written)


def test_truncated_chunk_detected_by_its_own_header(written):
    rewrite_chunk(written, lambda d: d[: len(d) - 64])  # index agrees: header still disagrees
    with pytest.raises(TruncatedChunkError, match="chunk-0-0.bin"):
        read_first(written)


def test_checksum_mismatch(written):
    def mutate(d):
        d[-20] ^= 0xFF
        return d

    rewrite_chunk(written, mutate, fix_index=False)
    with pytest.raises(ChecksumMismatchError, match="chunk-0-0.bin"):
        read_first(written)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_chunk_replaced_between_epochs_is_verified_again(written, workers):
    """A local chunk read and verified in one epoch, then replaced by another file (here
    the next chunk's bytes: the same size, a valid chunk): the next epoch of the same
    dataset checks it again and refuses it, in the process that verified it first too
    (it remembered chunks by number, and handed out the other chunk's items as these)."""
    from torch.utils.data import DataLoader

    from asynccache import StreamingDataset

    ds = StreamingDataset(str(written))
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    assert sorted(int(x["i"]) for x in loader) == list(range(10))
    first, second = sorted(p for p in os.listdir(written) if p.endswith(".bin"))[:2]
    assert os.path.getsize(written / first) == os.path.getsize(written / second)
    tmp = written / "replacement.tmp"
    tmp.write_bytes((written / second).read_bytes())
    os.replace(tmp, written / first)
    with pytest.raises(ChecksumMismatchError, match=first):
        list(loader)


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"format": "asynccache-index", "version": 7, "chunks": []}',
        '{"format": "asynccache-index", "version": 1, "chunks": [{"filename": "a.bin"}]}',
        '{"format": "asynccache-index", "version": 1, "chunks": [{"filename": "a.bin", '
        '"items": -1, "bytes": 1, "checksum": "xxh3_64:00"}]}',
    ],
)
def test_malformed_index(tmp_path, text):
    (tmp_path / "index.json").write_text(text)
    with pytest.raises(BadIndexError, match="index.json"):
        read_first(tmp_path)


def test_index_totals_must_agree(written):
    doc = load_unsealed(written / "index.json")
    doc["total_items"] += 1
    json.dump(doc, open(written / "index.json", "w"))
    with pytest.raises(BadIndexError, match="total_items"):
        read_first(written)


def test_index_keys_must_cover_every_item(written):
    doc = load_unsealed(written / "index.json")
    doc["chunks"][1]["keys"] = [[100, doc["chunks"][1]["items"]]]
    json.dump(doc, open(written / "index.json", "w"))
    with pytest.raises(BadIndexError, match="keys"):
        read_first(written)


@pytest.mark.parametrize(
    "name", ["../x.bin", "/etc/passwd", "a/../../x", "sub/x.bin", "..", "C:\\x", "a\\..\\x"]
)
def test_index_path_outside_directory(written, name):
    doc = load_unsealed(written / "index.json")
    doc["chunks"][0]["filename"] = name
    json.dump(doc, open(written / "index.json", "w"))
    with pytest.raises(UnsafePathError, match="outside"):
        read_first(written)


def test_missing_chunk_names_the_file(written):
    os.unlink(written / "chunk-0-1.bin")
    cache = Cache(written)
    assert cache[0]["i"] == 0
    with pytest.raises(ObjectNotFoundError, match="chunk-0-1.bin"):
        cache[5]


def test_every_error_is_an_asynccache_error():
    for cls in (
        BadMagicError,
        UnsupportedVersionError,
        TruncatedChunkError,
        ChecksumMismatchError,
        BadIndexError,
        UnsafePathError,
    ):
        assert issubclass(cls, AsyncCacheError) and issubclass(cls, ValueError)


def test_index_round_trips(written):
    idx = read_path(str(written / "index.json"))
    assert Index.from_json(idx.to_json(), "x").chunks == idx.chunks
    assert idx.total_items == 10 and idx.locate(9) == (2, 1)
