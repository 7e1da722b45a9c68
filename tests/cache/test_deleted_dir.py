"""The cache directory deleted after a dataset opened (issue "trust, second round", item
9): DataLoader workers of every start method still read every item. A spawned worker
unpickles the dataset's index, whose columns are mapped from the cached sidecar the
deletion removed: it maps the same file again through the process that pickled it."""

from __future__ import annotations

import gc
import pickle
import shutil
import threading

import pytest
import torch

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.errors import BadIndexError, CacheError
from asynccache.testing.faults import Fault, FaultProxy
from tests.helpers import uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(300)

ITEMS = 40


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory):
    src = write_noise_dataset(tmp_path_factory.mktemp("src"), ITEMS, per_chunk=5, size=128)
    with uploaded(src, objstore, "gone") as url:
        yield url


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_workers_read_after_the_cache_dir_is_deleted(remote, objstore, tmp_path, method) -> None:
    cache = tmp_path / "cache"
    ds = StreamingDataset(
        remote, cache_dir=cache, storage_options=objstore.storage_options, shuffle=True
    )
    assert ds.index.mapped  # a version-2 index: its columns are the cached sidecar
    shutil.rmtree(cache)
    loader = CacheDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=method)
    got = torch.cat([b["i"] for b in loader]).tolist()
    assert sorted(got) == list(range(ITEMS))
    assert any(p.name.endswith(".bin") for p in cache.rglob("chunk-*"))  # the cache, rebuilt
    ds.close()


def test_a_sidecar_nothing_reaches_is_named_when_used(remote, objstore, tmp_path) -> None:
    """Where nothing reaches the columns any more (deleted, and the index that held them
    collected), the unpickled index raises naming the missing file when used: a worker
    reports that as its exception, where failing to unpickle would end it unexplained."""
    cache = tmp_path / "cache"
    ds = StreamingDataset(remote, cache_dir=cache, storage_options=objstore.storage_options)
    blob = pickle.dumps(ds.index)
    path = next(p for p in cache.rglob("index-*.cols"))
    ds.close()
    del ds
    gc.collect()  # the index and the descriptor it kept of its sidecar
    shutil.rmtree(cache)
    index = pickle.loads(blob)
    with pytest.raises(BadIndexError, match="missing") as info:
        index.total_items  # noqa: B018 - the use that raises
    assert str(path) in str(info.value)
    again = pickle.loads(pickle.dumps(index))  # passed on as it came
    with pytest.raises(BadIndexError, match="missing"):
        again.num_chunks  # noqa: B018


def test_a_download_in_flight_when_the_cache_dir_is_deleted(remote, objstore, tmp_path) -> None:
    """The README's limit: a chunk downloading while its cache directory is deleted fails
    with ``CacheError`` naming that directory (nothing is published into a directory that
    is gone, and no half-written file is left); the dataset reads on afterwards, the
    directory made again."""
    cache = tmp_path / "cache"
    with FaultProxy(objstore.endpoint_url) as proxy:
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = StreamingDataset(remote, cache_dir=cache, storage_options=options)
        spec = ds.source.spec(0)
        proxy.add_fault(Fault("slow", path=spec.name, after_bytes=10, stall_s=1.5))
        fut = ds.source.downloader().ensure(spec.name, spec.size, spec.checksum)
        pause = threading.Event()
        for _ in range(400):  # bounded: until the chunk's body is held back mid-way
            if proxy.fired("slow"):
                break
            pause.wait(0.02)
        assert proxy.fired("slow") == 1
        shutil.rmtree(cache)
        with pytest.raises(CacheError, match="cache dir") as info:
            fut.result(timeout=60)
        assert str(cache) in str(info.value)
        assert not any(cache.rglob(f"*{spec.name}*"))  # nothing published, no temp file left
        assert ds[0]["i"] == 0  # the next read fetches it again
        assert any(cache.rglob(spec.name))
        ds.close()
