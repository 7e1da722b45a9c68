"""A child process never inherits the read side's mutexes or open-chunk table (issue 9, A).

Every test runs under fork, forkserver and spawn. Children are kept alive (blocked on an
event) while the parent goes on: the parent never waits on a child.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
from torch.utils.data import DataLoader

from asynccache.read.prefetch import prefetch
from asynccache.testing.faults import Fault, FaultProxy
from asynccache.torch.streaming import StreamingDataset
from tests.fork_read_children import read_all, take_locks
from tests.remote_data import upload_dataset, write_dataset

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

METHODS = ["fork", "forkserver", "spawn"]
N = 41
_WAIT_S = 60.0


@pytest.fixture(params=METHODS)
def ctx(request):
    return multiprocessing.get_context(request.param)


@pytest.fixture
def remote(tmp_path, objstore, bucket):
    src = write_dataset(tmp_path / "src", N, chunk_size=6)
    url = upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)
    return url, objstore.storage_options


def test_loader_workers_after_a_read_in_the_parent(remote, tmp_path, ctx) -> None:
    url, options = remote
    ds = StreamingDataset(url, cache_dir=tmp_path / "cc", storage_options=options)
    assert ds[0]["name"] == "item-0" and ds[40]["name"] == "item-40"
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx)
    names = sorted((item["name"] for item in loader), key=lambda s: int(s.split("-")[1]))
    assert names == [f"item-{i}" for i in range(N)]
    assert ds[7]["name"] == "item-7"  # the parent goes on reading


def test_fork_while_prefetch_runs(remote, tmp_path, objstore, ctx) -> None:
    url, options = remote
    cache = str(tmp_path / "cc")
    with FaultProxy(objstore.endpoint_url) as proxy:
        # One chunk answers slowly, so the fork surely happens mid-prefetch, with that
        # chunk's download lock held by the parent.
        proxy.add_fault(Fault("slow", path="chunk-0-3.bin", after_bytes=10, stall_s=2.0))
        via_proxy = dict(options, endpoint_url=proxy.url)
        result: dict = {}

        def run() -> None:
            try:
                result["stats"] = prefetch(url, cache, via_proxy)
            except BaseException as exc:
                result["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        out, go = ctx.Queue(), ctx.Event()
        try:
            pause = threading.Event()
            for _ in range(600):  # bounded: until the slow chunk is being served
                if proxy.fired("slow"):
                    break
                pause.wait(0.05)
            assert proxy.fired("slow") == 1
            child = ctx.Process(target=read_all, args=(url, cache, options, out, go), daemon=True)
            child.start()
            t.join(_WAIT_S)
            assert not t.is_alive() and "error" not in result, result
            assert result["stats"].chunks_fetched + result["stats"].hits == 7
            status, names = out.get(timeout=_WAIT_S)
            assert status == "ok", names
            assert names == [f"item-{i}" for i in range(N)]
            assert child.is_alive()  # the parent finished without waiting on it
        finally:
            go.set()
            t.join(_WAIT_S)
    child.join(_WAIT_S)
    assert child.exitcode == 0


def test_child_never_inherits_a_held_mutex(remote, tmp_path, ctx) -> None:
    url, options = remote
    ds = StreamingDataset(url, cache_dir=tmp_path / "cc", storage_options=options)
    assert ds[0]["name"] == "item-0"  # a chunk open and pinned in the parent
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ds.source._mu, ds.reader._lock:
            held.set()
            release.wait(_WAIT_S)

    holder = threading.Thread(target=hold)
    holder.start()
    out, go = ctx.Queue(), ctx.Event()
    try:
        assert held.wait(_WAIT_S)
        child = ctx.Process(target=take_locks, args=(ds, out, go), daemon=True)
        child.start()
        release.set()
        holder.join(_WAIT_S)
        assert ds[1]["name"] == "item-1"  # the parent goes on while the child lives
        status, *rest = out.get(timeout=_WAIT_S)
        assert status == "ok", rest
        locks, name, open_chunks = rest
        assert locks == [True, True] and name == "item-40"
        assert open_chunks == [6]  # its own mapping only, not the parent's table
        assert child.is_alive()
        assert ds[40]["name"] == "item-40"
    finally:
        release.set()
        go.set()
    child.join(_WAIT_S)
    assert child.exitcode == 0
