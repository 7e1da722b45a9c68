"""Items round-trip: every supported leaf, any nesting, zero-copy reads."""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from asynccache.errors import ConfigError, DataError, SerializationError
from asynccache.format import ChunkView, build, decode, encode, encoded_size
from tests.helpers import assert_same

TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
NP_DTYPES = [
    "<f4",
    "<f8",
    "<f2",
    "|u1",
    "|i1",
    "<i2",
    "<i4",
    "<i8",
    "<u8",
    "|b1",
    "<c8",
    "<M8[s]",
    "<U7",
]


def roundtrip(item, allow_pickle=False, compression=None):
    data = b"".join(
        bytes(p) for p in build([encode(item, allow_pickle=allow_pickle, compression=compression)])
    )
    view = ChunkView(data, "mem")
    start, end = view.span(0)
    return decode(data, start, end, where="mem", allow_pickle=allow_pickle)


def tensors():
    return st.builds(
        lambda dt, shape, seed: (
            torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100
        ).to(dt),
        st.sampled_from(TORCH_DTYPES),
        st.lists(st.integers(0, 4), max_size=3),
        st.integers(0, 2**31),
    )


def arrays():
    return st.builds(
        lambda dt, shape, seed: np.random.default_rng(seed).integers(0, 200, size=shape).astype(dt),
        st.sampled_from(NP_DTYPES),
        st.lists(st.integers(0, 4), max_size=3),
        st.integers(0, 2**31),
    )


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=50),
    tensors(),
    arrays(),
    st.sampled_from([np.float32(1.5), np.int64(-3), np.bool_(True), np.uint16(7)]),
)
pytrees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 5)), kids, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pytrees)
def test_any_pytree_round_trips(item):
    assert_same(item, roundtrip(item))


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3)])
def test_every_torch_dtype_and_shape(dtype, shape):
    t = (torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) * 3).to(dtype)
    assert_same(t, roundtrip(t))


def test_non_contiguous_and_grad_tensors_are_stored_as_values():
    base = torch.arange(12.0).reshape(3, 4)
    for t in (base.t(), base[:, ::2], torch.ones(3, requires_grad=True)):
        out = roundtrip(t)
        assert torch.equal(out, t.detach()) and out.is_contiguous()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "1", "P", "I", "F", "CMYK", "I;16"])
def test_pil_images_keep_mode_size_and_pixels(mode):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (7, 5, 3), dtype=np.uint8)).convert(mode)
    out = roundtrip(img)
    assert_same(img, out)


def test_big_ints_and_exact_types():
    item = {"big": 1 << 100, "neg": -(1 << 70), "tuple": (1, [2, (3,)]), 5: b"\x00\xff"}
    assert_same(item, roundtrip(item))


def test_unsupported_leaf_needs_pickle_opt_in():
    class Thing:
        def __eq__(self, other):
            return type(other) is type(self)

    with pytest.raises(SerializationError, match="Thing"):
        encode({"x": Thing()})
    with pytest.raises(SerializationError):
        encode(np.array([object()], dtype=object))


def test_pickle_opt_in_round_trips_and_is_refused_on_read_without_opt_in():
    item = {"s": {1, 2, 3}}
    assert roundtrip(item, allow_pickle=True) == item
    data = b"".join(bytes(p) for p in build([encode(item, allow_pickle=True)]))
    start, end = ChunkView(data, "mem").span(0)
    with pytest.raises(DataError, match="allow_pickle"):
        decode(data, start, end, where="mem")


def test_leaves_are_aligned_and_zero_copy_from_mmap():
    item = {"a": np.arange(1000, dtype=np.float64), "t": torch.arange(100, dtype=torch.int32)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.bin")
        with open(path, "wb") as f:
            for p in build([encode(item), encode(item)]):
                f.write(p)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        view = ChunkView(mm, path)
        whole = np.frombuffer(mm, dtype=np.uint8)
        for i in range(2):
            out = decode(mm, *view.span(i), where=path)
            assert np.shares_memory(out["a"], whole)
            assert out["a"].ctypes.data % 64 == 0
            assert out["t"].data_ptr() % 64 == 0
            assert np.shares_memory(out["t"].numpy(), whole)
            assert_same(item, out)


def test_corrupt_item_header_is_a_data_error():
    data = bytearray(b"".join(bytes(p) for p in build([encode({"a": 1})])))
    start, end = ChunkView(bytes(data), "mem").span(0)
    data[start + 4 : start + 12] = b"\xc1" * 8  # 0xc1 is never valid msgpack
    with pytest.raises(DataError, match="mem"):
        decode(bytes(data), start, end, where="mem")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pytrees)
def test_any_pytree_round_trips_compressed(item):
    assert_same(item, roundtrip(item, compression="zstd"))


def test_compression_shrinks_compressible_leaves_and_reads_back_writable():
    item = {
        "zeros": np.zeros(100_000, dtype=np.float32),
        "t": torch.zeros(50_000),
        "b": b"a" * 5000,
        "noise": np.random.default_rng(0).bytes(5000),
    }
    plain = encoded_size(encode(item))
    packed = encoded_size(encode(item, compression="zstd"))
    assert packed < plain / 10
    out = roundtrip(item, compression="zstd")
    assert_same(item, out)
    out["zeros"][0] = 1.0  # a private copy: writable
    out["t"][0] = 1.0


def test_unknown_compression_is_a_config_error():
    with pytest.raises(ConfigError, match="lz9"):
        encode({"x": b"y" * 4096}, compression="lz9")


def test_corrupt_compressed_buffer_is_a_data_error():
    data = bytearray(
        b"".join(bytes(p) for p in build([encode(np.zeros(4096), compression="zstd")]))
    )
    start, end = ChunkView(bytes(data), "mem").span(0)
    header_len = int.from_bytes(data[start : start + 4], "little")
    first_buffer = start + (4 + header_len + 63) // 64 * 64
    data[first_buffer : first_buffer + 8] = b"\xff" * 8  # the zstd frame's magic
    with pytest.raises(DataError, match="mem"):
        decode(bytes(data), start, end, where="mem")
