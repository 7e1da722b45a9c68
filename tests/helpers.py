"""Assertions and small datasets shared by the tests."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asynccache.testing import ObjectStore
from asynccache.write.writer import ChunkWriter, merge_dir
from tests.remote_data import upload_dataset


def noise_item(i: int, size: int) -> dict[str, Any]:
    """Item ``i``: its key and ``size`` bytes of noise seeded by ``i`` (so recomputable)."""
    return {"i": i, "x": np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)}


def write_noise_dataset(src: Path, n: int, per_chunk: int, size: int) -> Path:
    """Write items ``noise_item(0..n-1, size)`` in chunks of ``per_chunk`` into ``src``."""
    w = ChunkWriter(str(src), 0, chunk_size=per_chunk)
    for i in range(n):
        w.add(i, noise_item(i, size))
    w.finish()
    merge_dir(str(src), [0])
    return src


@contextlib.contextmanager
def uploaded(src: Path, objstore: ObjectStore, prefix: str) -> Iterator[str]:
    """``src`` uploaded into a fresh bucket named ``prefix-...``; yields the dataset's URL
    and deletes the bucket afterwards."""
    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    objstore.create_bucket(bucket)
    try:
        yield upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)
    finally:
        with contextlib.suppress(Exception):
            objstore.delete_bucket(bucket)


def assert_same(a: Any, b: Any, path: str = "item") -> None:
    """``a`` and ``b`` are equal values of the same type, dtype and shape (NaN == NaN)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert (
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            if a.numel()
            else True
        ), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert (a != a and b != b) or a == b, f"{path}: {a} != {b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif hasattr(a, "getdata") and hasattr(a, "mode"):  # PIL image
        assert (a.mode, a.size) == (b.mode, b.size), path
        assert np.array_equal(np.asarray(a), np.asarray(b)), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
