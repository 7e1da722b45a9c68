"""Per-chunk facts as arrays, and the optional ``tokens`` member of a chunk."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asynccache.errors import BadIndexError
from asynccache.format.index import ChunkEntry, Index

CK = "xxh3_64:0123456789abcdef"


def _index(tokens: list[int | None]) -> Index:
    chunks = tuple(
        ChunkEntry(f"c{i}.bin", 3, 100 + i, CK, ((3 * i, 3),), t) for i, t in enumerate(tokens)
    )
    return Index(chunks)


def test_arrays_match_the_chunks_and_tokens_round_trip() -> None:
    idx = Index.from_json(_index([5, 0, 7]).to_json(), "t")
    assert idx.items_per_chunk.tolist() == [3, 3, 3]
    assert idx.bytes_per_chunk.tolist() == [100, 101, 102]
    assert idx.tokens_per_chunk is not None
    assert idx.tokens_per_chunk.tolist() == [5, 0, 7]
    assert idx.items_per_chunk.dtype == np.int64
    assert not idx.items_per_chunk.flags.writeable


def test_tokens_omitted_when_unknown() -> None:
    idx = _index([5, None, 7])
    assert "tokens" not in json.loads(idx.to_json())["chunks"][1]
    assert Index.from_json(idx.to_json(), "t").tokens_per_chunk is None


def test_negative_tokens_refused_naming_the_file() -> None:
    doc = json.loads(_index([1, 2, 3]).to_json())
    del doc["index_checksum"]
    doc["chunks"][1]["tokens"] = -1
    with pytest.raises(BadIndexError, match=r"ds/index.json: c1.bin: tokens"):
        Index.from_json(json.dumps(doc), "ds/index.json")
