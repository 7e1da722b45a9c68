"""``asynccache.upload``: every file, bounded concurrency, ``index.json`` last, resumable."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from asynccache.config import Settings
from asynccache.errors import ConfigError, StorageError
from asynccache.storage import LocalStorage, open_storage
from asynccache.testing import ObjectStore
from asynccache.upload import UploadSummary, upload, upload_async

pytestmark = pytest.mark.timeout(90)

QUIET = Settings(progress=False, max_concurrency=4)
CHUNKS = [f"chunk-0-{i}.bin" for i in range(6)]


def _dataset(root: Path) -> dict[str, int]:
    """A written dataset: chunks, a writer index, index.json, plus files to leave out."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for i, name in enumerate(CHUNKS):
        data = os.urandom(50_000 + i * 1000)
        (root / name).write_bytes(data)
        sizes[name] = len(data)
    (root / "0.index.json").write_text(json.dumps({"writer": 0}))
    (root / "index.json").write_text(json.dumps({"version": 1, "chunks": CHUNKS}))
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


async def test_interrupted_upload_leaves_no_index_and_rerun_skips(tmp_path: Path) -> None:
    sizes = _dataset(tmp_path / "ds")
    broken = RecordingStorage(tmp_path / "dest", fail_on="chunk-0-3.bin")
    with pytest.raises(StorageError, match="injected"):
        await upload_async(broken, tmp_path / "ds", settings=QUIET)
    assert "index.json" not in broken.order
    assert not (tmp_path / "dest" / "index.json").exists()  # not committed
    done_before = set(broken.order)
    assert done_before  # something was uploaded before the failure

    again = RecordingStorage(tmp_path / "dest")
    summary = await upload_async(again, tmp_path / "ds", settings=QUIET)
    assert summary.skipped == len(done_before)
    assert set(again.order) == set(sizes) - done_before
    assert again.order[-1] == "index.json"


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
    assert (second.objects, second.skipped) == (1, len(sizes) - 1)  # only the commit again
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
