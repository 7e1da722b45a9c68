"""``DatasetSource.close()`` is final: no chunk lands in the cache after it returns."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import asynccache.download.downloader as downloader_mod
from asynccache.errors import BridgeError
from asynccache.read.source import DatasetSource
from tests.remote_data import upload_dataset, write_dataset

pytestmark = pytest.mark.timeout(120)


def _chunk_files(cache: Path) -> set[str]:
    """Every chunk file and temporary file under ``cache``, by name."""
    return {p.name for p in cache.rglob("*") if p.is_file() and ".bin" in p.name}


def test_a_download_verifying_at_close_lands_before_close_returns(
    tmp_path, objstore, bucket, monkeypatch
) -> None:
    src_dir = write_dataset(tmp_path / "src", 12, chunk_size=4)
    url = upload_dataset(src_dir, f"s3://{bucket}/ds", objstore.storage_options)
    cache = tmp_path / "cc"

    # A verify and publish that takes a while (a large chunk, a slow disk's fsync).
    entered, finished = threading.Event(), threading.Event()
    real = downloader_mod._verify_and_publish

    def slow_verify(tmp, spec, *args, **kwargs):
        if not spec.name.startswith("chunk-"):  # the index's sidecar, read at open
            return real(tmp, spec, *args, **kwargs)
        entered.set()
        time.sleep(0.5)
        try:
            return real(tmp, spec, *args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(downloader_mod, "_verify_and_publish", slow_verify)
    src = DatasetSource(url, cache_dir=cache, storage_options=objstore.storage_options)
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(src.acquire(0))
        except BaseException as exc:  # the close cancels it: recorded, not lost
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert entered.wait(30), "the download never reached its verify"
    assert not finished.is_set()
    src.close()
    at_close = _chunk_files(cache)
    assert finished.wait(30)
    reader.join(30)
    assert not reader.is_alive() and outcome
    # The read the close cut short says so.
    assert isinstance(outcome[0], BridgeError), outcome
    assert "closed while a read waited" in str(outcome[0])
    time.sleep(0.2)  # anything still landing would land now
    after = _chunk_files(cache)
    assert after == at_close, (at_close, after)
    # What survived: the chunk whose verify had begun, published; no temporary file.
    assert not [n for n in after if n.endswith(".tmp")], after
    assert src.index.filename(0) in after, after
