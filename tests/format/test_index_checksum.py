"""``index.json`` carries its own checksum: any damage is caught, never read as another index."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asynccache.cache.indexfile import read_path
from asynccache.errors import BadIndexError, CorruptIndexError
from asynccache.format import Index
from asynccache.format.index import INDEX_CHECKSUM_FIELD
from asynccache.torch.cache import Cache


@pytest.fixture
def index_bytes(tmp_path) -> bytes:
    cache = Cache(tmp_path, chunk_size=3)
    for i in range(7):
        cache[i] = {"x": np.full(4, i, dtype=np.int16), "i": i}
    cache.done()
    # the version-1 form of what was written (version 2 seals its index.json the same way)
    return read_path(str(tmp_path / "index.json")).to_json().encode()


def test_written_index_carries_its_checksum(index_bytes):
    doc = json.loads(index_bytes)
    assert doc[INDEX_CHECKSUM_FIELD].startswith("xxh3_64:")
    idx = Index.from_json(index_bytes, "index.json")
    assert idx.verified and idx.total_items == 7


def test_every_single_byte_flip_is_caught(index_bytes):
    good = Index.from_json(index_bytes, "index.json")
    for pos in range(len(index_bytes)):
        for flip in (0x01, 0x20):  # a low bit (digit 3 -> 2), a case bit (key -> KEY)
            data = bytearray(index_bytes)
            data[pos] ^= flip
            try:
                idx = Index.from_json(bytes(data), "some/index.json")
            except BadIndexError as exc:
                assert "some/index.json" in str(exc)
                continue
            # Parsed anyway: only whitespace-equivalent damage outside the checked body
            # can get here, and then the index must be exactly the same one.
            assert idx.to_json() == good.to_json(), f"byte {pos} ^ {flip:#x} read silently"


def test_damaged_value_raises_corrupt_index_naming_the_file(index_bytes):
    text = index_bytes.decode()
    doc = json.loads(text)
    size = str(doc["chunks"][0]["bytes"])
    damaged = text.replace(f'"bytes": {size}', f'"bytes": {int(size) + 1}', 1)
    assert damaged != text
    with pytest.raises(CorruptIndexError, match="s3://b/ds/index.json"):
        Index.from_json(damaged, "s3://b/ds/index.json")


def test_damaged_key_raises_corrupt_index(index_bytes):
    damaged = index_bytes.replace(b'"items"', b'"itens"', 1)
    with pytest.raises(CorruptIndexError, match="index.json"):
        Index.from_json(damaged, "index.json")


def test_index_without_checksum_is_read_unverified(index_bytes):
    doc = json.loads(index_bytes)
    del doc[INDEX_CHECKSUM_FIELD]
    idx = Index.from_json(json.dumps(doc), "index.json")
    assert not idx.verified
    assert idx == Index.from_json(index_bytes, "index.json")


def test_dataset_identity_ignores_the_index_checksum(index_bytes):
    """``Index.checksum`` names the dataset (cache dir, resume): content only."""
    idx = Index.from_json(index_bytes, "index.json")
    doc = json.loads(index_bytes)
    del doc[INDEX_CHECKSUM_FIELD]
    legacy = Index.from_json(json.dumps(doc), "index.json")
    assert idx.checksum == legacy.checksum
    assert Index.from_json(idx.to_json(), "x").checksum == idx.checksum
