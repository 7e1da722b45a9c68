"""``asynccache.upload``: every file, bounded concurrency, ``index.json`` last.

A re-upload skips a chunk only when the destination's own ``index.json`` records it with
the same checksum (and the object has that size): anything less is sent again.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from asynccache.config import Settings
from asynccache.errors import (
    ChecksumMismatchError,
    ConfigError,
    DatasetRewrittenError,
    StorageError,
)
from asynccache.format import ChunkEntry, Index, checksum
from asynccache.storage import LocalStorage, open_storage
from asynccache.testing import ObjectStore
from asynccache.torch.cache import Cache
from asynccache.write.upload import UploadSummary, upload, upload_async

pytestmark = pytest.mark.timeout(90)

QUIET = Settings(progress=False, max_concurrency=4)
CHUNKS = [f"chunk-0-{i}.bin" for i in range(6)]


def _dataset(root: Path) -> dict[str, int]:
    """A written dataset: chunks, a writer index, index.json, plus files to leave out.

    The chunks are random bytes (upload never parses them); ``index.json`` records their
    real sizes and checksums, one item each.
    """
    root.mkdir(parents=True, exist_ok=True)
    sizes = {}
    entries = []
    for i, name in enumerate(CHUNKS):
        data = os.urandom(50_000 + i * 1000)
        (root / name).write_bytes(data)
        sizes[name] = len(data)
        entries.append(ChunkEntry(name, 1, len(data), checksum(data), ((i, 1),)))
    (root / "0.index.json").write_text(json.dumps({"writer": 0}))
    (root / "index.json").write_text(Index(tuple(entries)).to_json())
    sizes["0.index.json"] = (root / "0.index.json").stat().st_size
    sizes["index.json"] = (root / "index.json").stat().st_size
    (root / ".chunk-0-9.bin.123.abc.tmp").write_bytes(b"partial")  # unfinished write
    (root / "chunk-0-7.bin.tmp").write_bytes(b"partial")
    return sizes


class RecordingStorage(LocalStorage):
    """A real local backend that records upload order and can fail on a chosen key."""

    def __init__(self, root: Path, fail_on: str | None = None) -> None:
        super().__init__(root)
        self.order: list[str] = []
        self.fail_on = fail_on

    async def _upload_impl(self, src: str, key: str) -> int:
        if key == self.fail_on:
            await asyncio.sleep(0.05)  # let others finish first
            raise StorageError(f"injected failure for {key}", url=self.object_url(key))
        n = await super()._upload_impl(src, key)
        self.order.append(key)
        return n


async def test_index_json_is_uploaded_last(tmp_path: Path) -> None:
    sizes = _dataset(tmp_path / "ds")
    dest = RecordingStorage(tmp_path / "dest")
    summary = await upload_async(dest, tmp_path / "ds", settings=QUIET)
    assert dest.order[-1] == "index.json"
    assert sorted(dest.order) == sorted(sizes)
    assert summary.objects == len(sizes) and summary.skipped == 0
    assert summary.bytes == sum(sizes.values())
    assert {o.key for o in await dest.list()} == set(sizes)  # no temp files went up


async def test_interrupted_upload_leaves_no_index_and_rerun_sends_everything(
    tmp_path: Path,
) -> None:
    sizes = _dataset(tmp_path / "ds")
    broken = RecordingStorage(tmp_path / "dest", fail_on="chunk-0-3.bin")
    with pytest.raises(StorageError, match="injected"):
        await upload_async(broken, tmp_path / "ds", settings=QUIET)
    assert "index.json" not in broken.order
    assert not (tmp_path / "dest" / "index.json").exists()  # not committed
    assert broken.order  # something was uploaded before the failure

    # No index.json at the destination records those objects, so nothing proves
    # they are these bytes: a same-size object is not enough. Everything goes again.
    again = RecordingStorage(tmp_path / "dest")
    summary = await upload_async(again, tmp_path / "ds", settings=QUIET)
    assert summary.skipped == 0
    assert sorted(again.order) == sorted(sizes)
    assert again.order[-1] == "index.json"


async def test_rerun_skips_exactly_the_chunks_the_remote_index_records(tmp_path: Path) -> None:
    sizes = _dataset(tmp_path / "ds")
    await upload_async(RecordingStorage(tmp_path / "dest"), tmp_path / "ds", settings=QUIET)
    again = RecordingStorage(tmp_path / "dest")
    summary = await upload_async(again, tmp_path / "ds", settings=QUIET)
    assert summary.skipped == len(CHUNKS)  # every chunk, by checksum
    assert again.order == ["0.index.json", "index.json"]  # no record: re-sent (small)
    assert summary.objects == len(sizes) - len(CHUNKS)


async def test_same_size_chunk_with_other_bytes_is_sent_again(tmp_path: Path) -> None:
    _dataset(tmp_path / "ds")
    await upload_async(RecordingStorage(tmp_path / "dest"), tmp_path / "ds", settings=QUIET)
    _dataset(tmp_path / "ds")  # rewritten: same names, same sizes, other bytes
    again = RecordingStorage(tmp_path / "dest")
    summary = await upload_async(again, tmp_path / "ds", settings=QUIET)
    assert summary.skipped == 0
    for name in CHUNKS:
        assert (tmp_path / "dest" / name).read_bytes() == (tmp_path / "ds" / name).read_bytes()


@pytest.mark.parametrize("damage", ["missing", "garbage", "corrupt"])
async def test_untrusted_remote_index_skips_nothing(tmp_path: Path, damage: str) -> None:
    _dataset(tmp_path / "ds")
    await upload_async(RecordingStorage(tmp_path / "dest"), tmp_path / "ds", settings=QUIET)
    remote_index = tmp_path / "dest" / "index.json"
    if damage == "missing":
        remote_index.unlink()
    elif damage == "garbage":
        remote_index.write_text("{not json")
    else:  # a digit of a chunk's size, as a bad disk or a bad proxy would change it
        text = remote_index.read_text()
        remote_index.write_text(text.replace('"bytes": 5', '"bytes": 6', 1))
    again = RecordingStorage(tmp_path / "dest")
    summary = await upload_async(again, tmp_path / "ds", settings=QUIET)
    assert summary.skipped == 0


async def test_interrupted_reupload_uncommits_then_a_rerun_repairs(tmp_path: Path) -> None:
    """A re-upload that dies after overwriting some chunks must not leave the old
    ``index.json`` vouching for them: a later upload of the old data would skip them."""
    _dataset(tmp_path / "v1")
    v1 = {n: (tmp_path / "v1" / n).read_bytes() for n in CHUNKS}
    await upload_async(RecordingStorage(tmp_path / "dest"), tmp_path / "v1", settings=QUIET)
    _dataset(tmp_path / "v2")
    broken = RecordingStorage(tmp_path / "dest", fail_on="chunk-0-5.bin")
    with pytest.raises(StorageError, match="injected"):
        await upload_async(broken, tmp_path / "v2", settings=QUIET)
    assert any(n in broken.order for n in CHUNKS)  # some chunks were overwritten
    assert not (tmp_path / "dest" / "index.json").exists()  # so the commit was withdrawn
    summary = await upload_async(
        RecordingStorage(tmp_path / "dest"), tmp_path / "v1", settings=QUIET
    )
    assert summary.skipped == 0
    assert {n: (tmp_path / "dest" / n).read_bytes() for n in CHUNKS} == v1


def test_upload_to_s3_then_rerun_skips(objstore: ObjectStore, bucket: str, tmp_path: Path) -> None:
    sizes = _dataset(tmp_path / "ds")
    url = f"s3://{bucket}/datasets/one"
    first = upload(tmp_path / "ds", url, objstore.storage_options, settings=QUIET)
    assert isinstance(first, UploadSummary)
    assert (first.objects, first.skipped, first.bytes) == (len(sizes), 0, sum(sizes.values()))
    assert first.seconds > 0

    async def listing() -> dict[str, int]:
        storage = open_storage(url, QUIET, objstore.storage_options)
        try:
            return {o.key: o.size for o in await storage.list()}
        finally:
            await storage.close()

    assert asyncio.run(listing()) == sizes
    second = upload(tmp_path / "ds", url, objstore.storage_options, settings=QUIET)
    # Every chunk is recorded in the remote index with the same checksum: skipped. The
    # writer index has no record (re-sent, small), and the commit always goes again.
    assert (second.objects, second.skipped) == (2, len(CHUNKS))
    with pytest.raises(AttributeError):
        second.objects = 3  # type: ignore[misc]


async def test_sync_upload_works_inside_a_running_loop(tmp_path: Path) -> None:
    sizes = _dataset(tmp_path / "ds")
    summary = upload(tmp_path / "ds", (tmp_path / "dest").as_uri(), settings=QUIET)
    assert summary.objects == len(sizes)
    assert (tmp_path / "dest" / "index.json").exists()


def test_not_a_dataset_dir(tmp_path: Path) -> None:
    (tmp_path / "chunk-0-0.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="index.json"):
        upload(tmp_path, str(tmp_path / "dest"), settings=QUIET)


def test_upload_to_http_is_refused(tmp_path: Path) -> None:
    _dataset(tmp_path / "ds")
    with pytest.raises(StorageError):
        upload(tmp_path / "ds", "http://127.0.0.1:9/ds", settings=QUIET)


def _write(root: Path, version: int) -> None:
    """The same shapes every version (so every chunk keeps its size); other values."""
    cache = Cache(root, chunk_size=4)
    for i in range(12):
        cache[i] = {"x": np.full(64, i * 1000 + version, dtype=np.int64), "v": version}
    cache.done()


def _values(cache: Cache) -> list[int]:
    return [int(cache[i]["x"][0]) for i in range(len(cache))]


def test_rewritten_dataset_reuploaded_reads_new_values(
    objstore: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/ds"
    opts = objstore.storage_options
    _write(tmp_path / "v1", 1)
    upload(tmp_path / "v1", url, opts, settings=QUIET)
    old = Cache(url, cache_dir=tmp_path / "old-reader", storage_options=opts)
    assert int(old[0]["x"][0]) == 1  # opened v1's index, holds chunk 0 of v1

    _write(tmp_path / "v2", 2)
    v1_sizes = sorted(p.stat().st_size for p in (tmp_path / "v1").glob("chunk-*"))
    assert sorted(p.stat().st_size for p in (tmp_path / "v2").glob("chunk-*")) == v1_sizes
    summary = upload(tmp_path / "v2", url, opts, settings=QUIET)
    assert summary.skipped == 0  # same sizes, other checksums: every chunk sent

    fresh = Cache(url, cache_dir=tmp_path / "new-reader", storage_options=opts)
    assert _values(fresh) == [i * 1000 + 2 for i in range(12)]

    # The reader of v1 gets v1 data or a clear error naming the changed chunk; never v2.
    seen = []
    for i in range(12):
        try:
            seen.append(int(old[i]["x"][0]))
        except ChecksumMismatchError as exc:
            message = str(exc)
            assert message.startswith(f"{url}/chunk-0-")
            assert "changed since this reader opened index.json" in message
            assert "rewritten" in message and isinstance(exc, DatasetRewrittenError)
            break
    else:
        pytest.fail("the reader of v1 read every item although v2 replaced its chunks")
    assert seen == [i * 1000 + 1 for i in range(len(seen))]

    again = upload(tmp_path / "v2", url, opts, settings=QUIET)
    assert again.skipped == 4  # identical: every chunk skipped, by checksum, and the
    # index's column sidecar, by its content-addressed name
