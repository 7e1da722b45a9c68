"""Resources stay bounded whatever the dataset size or the number of datasets (issue 9, B)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

import asynccache.download.downloader as downloader_mod
from asynccache.bridge import get_loop_thread
from asynccache.config import Settings
from asynccache.read.prefetch import prefetch
from asynccache.read.source import DatasetSource
from asynccache.torch.streaming import StreamingDataset
from tests.remote_data import upload_dataset, write_dataset

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def thousand_chunks(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("ds1000"), 1000, chunk_size=1)


def test_prefetch_of_1000_chunks_under_a_low_descriptor_limit(
    thousand_chunks, http_origin, tmp_path
) -> None:
    server = http_origin(thousand_chunks)
    script = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        from asynccache.config import Settings
        from asynccache import prefetch
        settings = Settings.from_env(progress=False, max_concurrency=8)
        stats = prefetch({server.url!r}, {str(tmp_path / "cc")!r}, settings=settings)
        print("fetched", stats.chunks_fetched, "peak", stats.peak_inflight)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=150
    )
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    assert words[:2] == ["fetched", "1000"], out.stdout
    assert 1 <= int(words[3]) <= 16  # a bounded window: 2 x max_concurrency at most


def test_prefetch_keeps_a_bounded_window_of_downloads(
    thousand_chunks, http_origin, tmp_path
) -> None:
    server = http_origin(thousand_chunks)
    settings = Settings.from_env(progress=False, max_concurrency=3)
    stats = prefetch(server.url, tmp_path / "cc", settings=settings)
    assert stats.chunks_fetched == 1000
    assert 1 <= stats.peak_inflight <= 6


def test_prefetch_builds_one_downloader(thousand_chunks, http_origin, tmp_path, monkeypatch):
    server = http_origin(thousand_chunks)
    made = []
    init = downloader_mod.Downloader.__init__

    def counting_init(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(downloader_mod.Downloader, "__init__", counting_init)
    stats = prefetch(server.url, tmp_path / "cc", settings=Settings.from_env(progress=False))
    assert stats.chunks_fetched == 1000
    # one for the chunks, and one that fetched the index's column sidecar when the
    # dataset was opened (not one per chunk)
    assert len(made) == 2


@pytest.fixture
def remote(tmp_path, objstore, bucket):
    src = write_dataset(tmp_path / "src", 12, chunk_size=4)
    return upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options), objstore


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settle() -> tuple[int, int]:
    gc.collect()
    lt = get_loop_thread()
    lt.settle(30)
    return _fds(), lt.closer_count


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["source", "streaming"])
def test_dropped_datasets_release_sessions(remote, tmp_path, kind) -> None:
    url, objstore = remote
    cache = tmp_path / "cc"

    def use_one() -> None:
        if kind == "source":
            src = DatasetSource(url, cache_dir=cache, storage_options=objstore.storage_options)
            src.acquire(1)
            src.release(1)
        else:
            ds = StreamingDataset(url, cache_dir=cache, storage_options=objstore.storage_options)
            assert ds[5]["name"] == "item-5"

    for _ in range(5):
        use_one()
    fds, closers = _settle()
    for _ in range(100):
        use_one()
    fds_after, closers_after = _settle()
    assert closers_after <= closers
    assert fds_after <= fds + 4, (fds, fds_after)


@pytest.mark.slow
def test_close_releases_at_once_and_is_idempotent(remote, tmp_path) -> None:
    url, objstore = remote
    lt = get_loop_thread()
    fds, closers = _settle()
    with DatasetSource(
        url, cache_dir=tmp_path / "cc", storage_options=objstore.storage_options
    ) as src:
        src.acquire(0)
        assert lt.closer_count == closers + 1
    assert lt.closer_count == closers
    src.release(0)  # its pin went with the closed connection: nothing to release
    src.close()
    lt.settle(30)
    assert _fds() <= fds + 1
    assert src.acquire(2)  # a closed source reconnects when used again
    src.release(2)
    src.close()


def test_streaming_dataset_close_releases_and_reconnects(remote, tmp_path) -> None:
    url, objstore = remote
    lt = get_loop_thread()
    _, closers = _settle()
    with StreamingDataset(
        url, cache_dir=tmp_path / "cc", storage_options=objstore.storage_options
    ) as ds:
        assert ds[0]["i"] == 0
        assert lt.closer_count == closers + 1
        assert ds.source.store is not None and ds.source.store.pinned()
    assert lt.closer_count == closers
    assert ds.source.store is None  # pins and connection went with close()
    assert ds[3]["i"] == 3  # a closed dataset reconnects when used again
    ds.close()
    assert lt.closer_count == closers
