"""Writing token datasets: the writer's and optimize's checks, and key-order compaction."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache import optimize
from asynccache.config import Settings
from asynccache.errors import ConfigError, SerializationError
from asynccache.read.reader import Reader
from asynccache.read.token_blocks import TokenBlocks
from asynccache.write.writer import ChunkWriter, merge_dir

from .corpus import documents


def _doc(i: int) -> np.ndarray:
    return np.arange(i * 10, i * 10 + 7, dtype=np.int64)


def _items(i: int) -> dict:
    return {"i": i}


def test_shuffled_keys_are_compacted_into_a_token_dataset_in_key_order(tmp_path):
    docs = documents([50 + (i * 37) % 200 for i in range(40)], seed=4)
    w = ChunkWriter(str(tmp_path), 0, chunk_bytes=4096, tokens="uint16")
    for k in np.random.default_rng(1).permutation(len(docs)).tolist():
        w.add(k, docs[k])  # keys out of order: the merge rewrites the chunks in key order
    w.finish()
    index = merge_dir(str(tmp_path), [0])
    assert all(len(c.keys) == 1 for c in index.chunks), "compacted"
    assert index.config["token_dtype"] == "uint16"
    assert sum(index.tokens_per_chunk.tolist()) == sum(len(d) for d in docs)
    reader = Reader(index, lambda ci, e: f"{tmp_path}/{e.filename}")
    units = TokenBlocks(100).bind(index)
    got = np.concatenate([units.read(reader, b) for b in range(len(units))])
    assert np.array_equal(got, np.concatenate(docs)[: len(got)])


def test_bad_token_arguments_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="token dtype must be one of"):
        ChunkWriter(str(tmp_path / "a"), 0, tokens="float32")
    with pytest.raises(ConfigError, match="can't be combined"):
        ChunkWriter(str(tmp_path / "b"), 0, tokens="uint16", compression="zstd")
    w = ChunkWriter(str(tmp_path / "c"), 0, tokens="uint8")
    with pytest.raises(SerializationError, match="300 does not fit tokens=uint8"):
        w.add(0, [1, 300])
    settings = Settings.from_env(progress=False)
    with pytest.raises(ConfigError, match="can't be combined"):
        optimize(_doc, [0], str(tmp_path / "d"), num_workers=0, tokens="uint16",
                 compression="zstd", settings=settings)  # fmt: skip


def test_optimize_refuses_to_append_another_kind(tmp_path):
    out = str(tmp_path / "ds")
    settings = Settings.from_env(progress=False)
    optimize(_doc, list(range(5)), out, num_workers=0, tokens="uint16", settings=settings)
    with pytest.raises(ConfigError, match="can't append with tokens=None"):
        optimize(_items, [0], out, num_workers=0, mode="append", settings=settings)
    with pytest.raises(ConfigError, match="can't append with tokens='int32'"):
        optimize(_doc, [5], out, num_workers=0, mode="append", tokens="int32", settings=settings)
    result = optimize(
        _doc, [5, 6], out, num_workers=0, mode="append", tokens="uint16", settings=settings
    )
    index = result.index
    assert index.total_items == 7 and index.config["token_dtype"] == "uint16"
    reader = Reader(index, lambda ci, e: f"{out}/{e.filename}")
    assert np.array_equal(reader[6], _doc(6))
    assert sum(index.tokens_per_chunk.tolist()) == 7 * 7
