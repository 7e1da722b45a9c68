"""Chunk names from an index are checked when it opens, and the cache names its files
itself (issue "trust, second round", item 12): a name no file system takes is a
:class:`BadIndexError` naming the index and the chunk, before any chunk is read; a long
name that a file system takes is cached under a short local name."""

from __future__ import annotations

import asyncio

import pytest
from renamed import rename_chunks

from asynccache import StreamingDataset
from asynccache.config import Settings
from asynccache.errors import BadIndexError
from asynccache.format import INDEX_NAME
from asynccache.format.columns import NAME_RE
from asynccache.read.source import DatasetSource
from asynccache.storage import open_storage
from tests.helpers import uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(120)

ITEMS = 12
LONG = "c" * 300 + ".bin"  # ENAMETOOLONG as a file name anywhere


def _long_third(c: int) -> str:
    return LONG if c == 2 else f"part-{c}.bin"


@pytest.mark.parametrize("version", [1, 2])
def test_a_name_too_long_for_any_file_system_fails_at_open(tmp_path, version) -> None:
    src = write_noise_dataset(tmp_path / "src", ITEMS, per_chunk=4, size=32)
    rename_chunks(src, _long_third, version=version)
    with pytest.raises(BadIndexError) as info:
        StreamingDataset(src)
    message = str(info.value)
    assert str(src / INDEX_NAME) in message  # the index
    assert "c" * 40 in message  # the chunk
    if version == 2:
        assert "chunk 2" in message


@pytest.mark.parametrize("bad", ["a\0b.bin", "../x.bin", "d/x.bin", ".."])
def test_unsafe_names_fail_at_open(tmp_path, bad) -> None:
    src = write_noise_dataset(tmp_path / "src", ITEMS, per_chunk=4, size=32)
    rename_chunks(src, lambda c: bad if c == 1 else f"part-{c}.bin", version=1)
    with pytest.raises(BadIndexError, match=str(src / INDEX_NAME)):
        StreamingDataset(src)


def test_a_long_pattern_fails_at_open(tmp_path) -> None:
    src = write_noise_dataset(tmp_path / "src", ITEMS, per_chunk=4, size=32)
    # One pattern with a number: the names are x...x-<n>.bin, the longest 256 bytes.
    rename_chunks(src, lambda c: "x" * 245 + f"-{10**7 + c}.bin")
    with pytest.raises(BadIndexError, match="longer than a file name may be") as info:
        StreamingDataset(src)
    assert str(src / INDEX_NAME) in str(info.value)


def test_a_remote_index_with_a_name_too_long_fails_at_open(objstore, tmp_path) -> None:
    src = write_noise_dataset(tmp_path / "src", ITEMS, per_chunk=4, size=32)
    with uploaded(src, objstore, "names") as url:
        rename_chunks(src, _long_third)  # the new index only: its chunks never get read
        settings = Settings.from_env(progress=False, cache_dir=str(tmp_path / "cache"))
        storage = open_storage(url, settings, objstore.storage_options)

        async def put() -> None:
            try:
                for f in src.iterdir():
                    if NAME_RE.match(f.name):
                        await storage.upload(str(f), f.name)
                await storage.upload(str(src / INDEX_NAME), INDEX_NAME)  # the commit, last
            finally:
                await storage.close()

        asyncio.run(put())
        with pytest.raises(BadIndexError) as info:
            DatasetSource(url, settings=settings, storage_options=objstore.storage_options)
        assert f"{url}/{INDEX_NAME}" in str(info.value) and "chunk 2" in str(info.value)


def test_long_names_are_cached_under_short_local_names(objstore, tmp_path) -> None:
    """240 bytes is a file name, but not with the temporary file's suffix around it."""
    src = write_noise_dataset(tmp_path / "src", ITEMS, per_chunk=4, size=32)
    index = rename_chunks(src, lambda c: f"{c:03d}-" + "n" * 232 + ".bin")
    with uploaded(src, objstore, "names") as url:
        opts = objstore.storage_options
        ds = StreamingDataset(url, cache_dir=tmp_path / "cache", storage_options=opts)
        assert sorted(int(item["i"]) for item in ds) == list(range(ITEMS))
        ds.close()
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and ".locks" not in p.parts]
    chunks = [p for p in files if p.name.startswith("chunk-~")]
    assert len(chunks) == index.num_chunks
    assert all(len(p.name) < 64 for p in files)


@pytest.mark.parametrize("version", [1, 2])
def test_a_chunk_named_like_a_column_sidecar_fails_at_open(tmp_path, version) -> None:
    """The cache keeps column sidecars outside its budget: no chunk may pass for one."""
    src = write_noise_dataset(tmp_path / "src", ITEMS, per_chunk=4, size=32)
    rename_chunks(
        src, lambda c: f"index-{c:016x}.cols" if c == 1 else f"part-{c}.bin", version=version
    )
    with pytest.raises(BadIndexError, match="column sidecar") as info:
        StreamingDataset(src)
    assert str(src / INDEX_NAME) in str(info.value) and "chunk 1" in str(info.value)
