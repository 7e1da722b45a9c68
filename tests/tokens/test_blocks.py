"""Token chunks and fixed-length blocks: what is read is exactly the documents written."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccache.errors import ConfigError, DataError, SerializationError, UnsupportedVersionError
from asynccache.format import ChunkView, Index
from asynccache.format.tokens import dtype_of_flags, encode_tokens, token_dtype
from asynccache.read.reader import Reader
from asynccache.read.token_blocks import TokenBlocks
from asynccache.sampling.blocks import BlockLayout
from asynccache.write.writer import ChunkWriter, merge_dir

from .corpus import documents, write_tokens


def _reader(directory: str, index: Index) -> Reader:
    return Reader(index, lambda ci, e: f"{directory}/{e.filename}")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=0, max_size=25),
    block=st.integers(1, 400),
    chunk_bytes=st.sampled_from([64, 200, 1000, 1 << 20]),
    dtype=st.sampled_from(["uint16", "int32", "uint8"]),
)
def test_blocks_are_the_concatenated_documents(
    tmp_path_factory, lengths, block, chunk_bytes, dtype
):
    """Concatenated blocks equal the concatenated documents, tail aside, whatever the chunk
    boundaries: blocks spanning 2+ chunks and documents longer than a chunk included."""
    d = str(tmp_path_factory.mktemp("tok"))
    high = 250 if dtype == "uint8" else 60000
    docs = documents(lengths, seed=len(lengths) * 7 + block, high=high)
    index = write_tokens(d, docs, chunk_bytes=chunk_bytes, dtype=dtype)
    reader = _reader(d, index)
    units = TokenBlocks(block).bind(index)
    stream = np.concatenate(docs) if docs else np.empty(0, np.int64)
    assert units.total_tokens == len(stream)
    assert len(units) == len(stream) // block  # from the index alone
    got = [units.read(reader, b) for b in range(len(units))]
    assert all(g.dtype == np.dtype(dtype) and len(g) == block for g in got)
    want = stream[: len(units) * block]
    assert np.array_equal(np.concatenate(got) if got else want[:0], want)
    # A batch copied row by row (blocks in shuffled order, into rows in another order,
    # spanning blocks included) holds the same blocks, and nothing else is written.
    if len(units):
        rng = np.random.default_rng(block)
        keys = rng.permutation(len(units))
        at = rng.permutation(len(units) + 2)[: len(units)]
        rows = np.full((len(units) + 2, block), 7, dtype)
        units.assemble_into(reader, keys, rows, at=at)
        for k, r in zip(keys.tolist(), at.tolist(), strict=True):
            assert np.array_equal(rows[r], got[k])
        untouched = np.setdiff1d(np.arange(len(rows)), at)
        assert (rows[untouched] == 7).all()
    # Each block is owned by the chunk it starts in, in storage order: keys_of covers
    # every block once, and each touches the chunks its pieces name.
    owned = np.concatenate([units.keys_of(c) for c in range(len(index.chunks))] or [[]])
    assert np.array_equal(owned, np.arange(len(units)))
    if len(units):
        b = np.arange(len(units))
        first, last = units.chunks_of(b), units.last_chunks(b)
        for k in range(len(units)):
            pieces = units.layout.pieces(k)
            assert (pieces[0][0], pieces[-1][0]) == (first[k], last[k])
    # Documents still read one by one, as views of their chunk.
    for i, doc in enumerate(docs):
        assert np.array_equal(reader[i], doc)
    reader.close()


def test_in_chunk_blocks_share_memory_with_the_mapping(tmp_path):
    docs = documents([1000, 700, 1500, 300, 2000])
    index = write_tokens(str(tmp_path), docs, chunk_bytes=4096)  # ~2000 tokens a chunk
    reader = _reader(str(tmp_path), index)
    units = TokenBlocks(300).bind(index)
    assert len(index.chunks) > 2
    inside = spans = 0
    for b in range(len(units)):
        block = units.read(reader, b)
        c = int(units.chunks_of(np.array([b]))[0])
        chunk = reader.chunk_tokens(c)
        if int(units.last_chunks(np.array([b]))[0]) == c:
            assert np.shares_memory(block, chunk)
            inside += 1
        else:
            assert not np.shares_memory(block, chunk)  # assembled: one copy
            spans += 1
    assert inside and spans


def test_layout_with_empty_chunks_and_exact_fits():
    lay = BlockLayout([0, 5, 0, 5, 0], 5)
    assert len(lay) == 2
    assert lay.blocks_per_chunk.tolist() == [0, 1, 0, 1, 0]
    assert lay.chunks_of(np.array([0, 1])).tolist() == [1, 3]
    assert lay.last_chunks(np.array([0, 1])).tolist() == [1, 3]
    assert lay.pieces(1) == [(3, 0, 5)]
    lay = BlockLayout([3, 0, 3, 4], 4)  # block 0 spans chunks 0 and 2 (1 is empty)
    assert lay.pieces(0) == [(0, 0, 3), (2, 0, 1)]
    assert lay.pieces(1) == [(2, 1, 3), (3, 0, 2)]
    assert lay.blocks_per_chunk.tolist() == [1, 0, 1, 0]  # the tail (2 tokens) is dropped
    with pytest.raises(IndexError):
        lay.pieces(2)


def test_token_values_are_checked_and_dtypes_named():
    dt = token_dtype("uint16")
    assert bytes(encode_tokens([1, 2, 65535], dt)[0]) == np.array([1, 2, 65535], "<u2").tobytes()
    with pytest.raises(SerializationError, match="65536 does not fit tokens=uint16"):
        encode_tokens(np.array([1, 65536]), dt)
    with pytest.raises(SerializationError, match="-1 does not fit"):
        encode_tokens([-1], dt)
    with pytest.raises(SerializationError, match="1-D"):
        encode_tokens(np.zeros((2, 2), np.int64), dt)
    with pytest.raises(SerializationError, match="integers"):
        encode_tokens(np.zeros(3, np.float32), dt)
    with pytest.raises(ConfigError, match="token dtype must be one of"):
        token_dtype("float16")
    with pytest.raises(UnsupportedVersionError, match="bits this release does not know"):
        dtype_of_flags(1 << 20, "x.bin")
    with pytest.raises(ConfigError, match="block_size"):
        TokenBlocks(0)


def test_token_chunk_damage_is_refused(tmp_path):
    index = write_tokens(str(tmp_path), documents([10, 11]), dtype="uint16")
    path = f"{tmp_path}/{index.chunks[0].filename}"
    data = bytearray(open(path, "rb").read())
    data[12:16] = (1 | (77 << 8)).to_bytes(4, "little")  # an unknown dtype code
    with pytest.raises(UnsupportedVersionError, match="dtype code 77"):
        ChunkView(bytes(data), path)


def test_item_dataset_is_not_token_blocks(tmp_path):
    w = ChunkWriter(str(tmp_path), 0)
    w.add(0, np.arange(5))
    w.finish()
    index = merge_dir(str(tmp_path), [0])
    with pytest.raises(DataError, match="not a token dataset"):
        TokenBlocks(4).bind(index, str(tmp_path))
