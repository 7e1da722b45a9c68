"""The cache reads, counts and removes only files it created (issue 9, point 1)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from asynccache.cache import ChunkStore, dataset_dir

pytestmark = pytest.mark.timeout(30)

OLD = 1_000_000.0  # an mtime far older than anything the cache publishes


def _foreign(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"u" * size)
    os.utime(path, (OLD, OLD))
    return path


def _publish(store: ChunkStore, name: str, size: int) -> None:
    tmp = store.create_temp(name, size)
    tmp.pwrite(b"x" * size, 0)
    tmp.publish()


def test_foreign_files_survive_eviction_and_are_not_counted(tmp_path: Path) -> None:
    cache = tmp_path / "scratch"
    store = ChunkStore(dataset_dir(cache, "s3://b/ds", "v1"), max_cache_bytes=300)
    big = 1 << 20  # far above the budget, and older than every chunk
    foreign = [
        _foreign(cache / "checkpoints" / "model.pt", big),
        _foreign(cache / "model.bin", big),
        _foreign(cache / "notes.txt", big),
        _foreign(store.root / "model.pt", big),  # inside our own dataset directory
        _foreign(store.root / "readme.bin", big),
        # a user's directory that happens to have a dataset-like name, but no marker
        _foreign(cache / ("ab" * 16) / "chunk-0-0.bin", big),
    ]
    _publish(store, "chunk-0-0.bin", 100)
    _publish(store, "chunk-0-1.bin", 100)
    assert store.used_bytes() == 200

    asyncio.run(store.make_room(250))  # needs 150 more bytes than the budget allows
    tmp = asyncio.run(store.reserve("chunk-0-2.bin", 200))
    tmp.pwrite(b"y" * 200, 0)
    tmp.publish()

    for path in foreign:
        assert path.stat().st_size == big, f"{path} was touched"
    assert not store.is_cached("chunk-0-0.bin") and not store.is_cached("chunk-0-1.bin")
    assert store.is_cached("chunk-0-2.bin")
    assert store.used_bytes() == 200


def test_another_marked_dataset_is_counted_and_evicted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old = ChunkStore(dataset_dir(cache, "s3://b/ds", "v1"), max_cache_bytes=200)
    _publish(old, "chunk-0-0.bin", 150)
    os.utime(old.path("chunk-0-0.bin"), (OLD, OLD))
    new = ChunkStore(dataset_dir(cache, "s3://b/ds", "v2"), max_cache_bytes=200)
    assert new.used_bytes() == 150
    asyncio.run(new.reserve("chunk-0-0.bin", 100)).discard()
    assert not old.is_cached("chunk-0-0.bin")
    assert (old.root / ".locks" / ".asynccache-dataset").is_file()


def test_names() -> None:
    from asynccache.cache.layout import is_chunk_name, is_temp_name

    assert is_chunk_name("chunk-0-12.bin") and is_chunk_name("chunk-3-0.bin")
    assert not is_chunk_name("model.bin") and not is_chunk_name(".chunk-0-0.bin")
    assert is_temp_name(".chunk-0-1.bin.123.0a1b2c3d.tmp")
    assert not is_temp_name(".session.tmp") and not is_temp_name(".x.tmp")
