"""``DatasetSource.close()`` is final: no chunk lands in the cache after it returns."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynccache.download.downloader as downloader_mod
from asynccache import CacheDataLoader, StreamingDataset
from asynccache.config import Settings
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


@pytest.fixture(scope="module")
def twelve_chunks(objstore, tmp_path_factory):
    """12 chunks of about 128 KiB in a bucket of this module; the directory they came from."""
    src = write_dataset(tmp_path_factory.mktemp("src12"), 24, chunk_size=2, pad=64 << 10)
    name = f"close-{uuid.uuid4().hex[:12]}"
    objstore.create_bucket(name)
    yield upload_dataset(src, f"s3://{name}/ds", objstore.storage_options), src
    objstore.delete_bucket(name)


@settings(
    max_examples=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    batches=st.integers(0, 12),
    prefetch=st.sampled_from([1, 4, 12]),
    verify_s=st.sampled_from([0.0, 0.05]),
)
def test_close_at_any_point_of_an_epoch_is_final(
    twelve_chunks, objstore, tmp_path_factory, batches, prefetch, verify_s
) -> None:
    """A loop that leaves an epoch after ``batches`` batches (one chunk each; the epoch's
    prefetches in flight, each chunk's verify taking ``verify_s`` more) and closes the
    dataset: nothing lands after the close, no temporary file is left, every chunk left
    is whole, and the closed dataset reads again."""
    url, src_dir = twelve_chunks
    cache = tmp_path_factory.mktemp("close-cache")
    options = Settings.from_env(progress=False, prefetch_chunks=prefetch)
    real = downloader_mod._verify_and_publish

    def slow_verify(tmp, spec, *args, **kwargs):
        if spec.name.startswith("chunk-"):
            time.sleep(verify_s)
        return real(tmp, spec, *args, **kwargs)

    ds = StreamingDataset(
        url, cache_dir=cache, storage_options=objstore.storage_options, settings=options
    )
    with mock.patch.object(downloader_mod, "_verify_and_publish", slow_verify):
        loader = CacheDataLoader(ds, batch_size=2, num_workers=0)
        it = iter(loader)
        seen = [next(it) for _ in range(batches)]
        assert [int(i) for b in seen for i in b["i"]] == list(range(2 * batches))
        del it
        ds.close()
    at_close = {p.name: p.stat().st_size for p in cache.rglob("*.bin*") if p.is_file()}
    time.sleep(0.3)  # a download the close missed would land now
    after = {p.name: p.stat().st_size for p in cache.rglob("*.bin*") if p.is_file()}
    assert after == at_close
    assert not [n for n in after if n.endswith(".tmp")], after
    for name in after:
        if name.endswith(".bin"):
            cached = next(cache.rglob(name)).read_bytes()
            assert cached == (src_dir / name).read_bytes(), name
    # A closed dataset reconnects when used again.
    assert ds[2 * batches % 24]["i"] == 2 * batches % 24
    ds.close()
