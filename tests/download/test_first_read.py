"""The first batch of an epoch read by HTTP Range before its chunks land (issue 17 part 3).

A real SeaweedFS behind the real fault proxy: the proxy holds back the whole-chunk GET of
the first chunk (``slow``), so the reader surely asks for its first items before that
chunk lands, and logs every request so the range GETs can be counted.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from torch.utils.data import DataLoader

from asynccache.config import Settings
from asynccache.format import ChunkView, checksum
from asynccache.format.chunk import items_start
from asynccache.testing.faults import Fault, FaultProxy
from asynccache.torch.streaming import StreamingDataset
from tests.helpers import noise_item, uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(120)

N, PER_CHUNK, ITEM = 96, 32, 48 << 10  # chunks of 1.5 MiB: range reads start at 1 MiB
EARLY = 10 * ITEM  # the range-read budget: about 9 items of the first chunk


def _item(i: int) -> dict:
    return noise_item(i, ITEM)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_noise_dataset(tmp_path_factory.mktemp("first") / "src", N, PER_CHUNK, ITEM)


@pytest.fixture(scope="module")
def remote(written, objstore):
    with uploaded(written, objstore, "first") as url:
        yield url


def _first_chunk(src) -> tuple[str, int, int]:
    """Name, size and first item offset of the dataset's first chunk."""
    name = sorted(f for f in os.listdir(src) if f.endswith(".bin"))[0]
    data = (src / name).read_bytes()
    return name, len(data), ChunkView(data, name).span(0)[0]


def _range_gets(proxy: FaultProxy, size: int) -> list[tuple[str, str]]:
    """The GETs of chunks that asked for part of a chunk other than a whole-chunk part."""
    return [
        (r.path.rsplit("/", 1)[1], r.range)
        for r in proxy.requests
        if r.method == "GET" and r.path.endswith(".bin") and r.range != f"bytes=0-{size - 1}"
    ]


def _dataset(url, options, tmp_path, early=EARLY, **kw) -> StreamingDataset:
    settings = Settings.from_env(progress=False, first_read_bytes=early)
    return StreamingDataset(
        url, cache_dir=tmp_path / "cc", storage_options=options, settings=settings, **kw
    )


def test_first_items_by_range_are_the_chunk_items_and_stop_once_chunks_land(
    remote, written, objstore, tmp_path
):
    name, size, first = _first_chunk(written)
    with FaultProxy(objstore.endpoint_url) as proxy:
        # The first chunk's whole GET waits, so the first items can only come by range.
        proxy.add_fault(Fault("slow", path=name, range=f"bytes=0-{size - 1}", stall_s=1.0))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(remote, options, tmp_path)
        got = list(ds)
        assert proxy.fired("slow") == 1
        ranged = _range_gets(proxy, size)
        # One round for the header, one for the first items (coalesced), first chunk only.
        assert ranged == [
            (name, f"bytes=0-{items_start(PER_CHUNK) - 1}"),
            (name, ranged[1][1]),
        ], ranged
        lo = int(ranged[1][1].removeprefix("bytes=").split("-")[0])
        assert lo == first
        stats = ds.source.stats
        assert stats.range_gets == 2 and 0 < stats.range_bytes <= EARLY + items_start(PER_CHUNK)
        assert stats.chunks_fetched == N // PER_CHUNK  # each chunk still downloaded once
        # The same items, bit for bit, as read from the chunks; writable, as mapped ones.
        assert [g["i"] for g in got] == list(range(N))
        for g in got:
            np.testing.assert_array_equal(g["x"], _item(g["i"])["x"])
        assert got[0]["x"].flags.writeable and got[0]["x"].ctypes.data % 64 == 0
        # Every chunk was published verified.
        cached = {f: os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "cc") for f in fs}
        for f in (p for p in os.listdir(written) if p.endswith(".bin")):
            with open(cached[f], "rb") as fh:
                assert checksum(fh.read()) == checksum((written / f).read_bytes())
        # A second epoch finds every chunk here: no range read.
        before = len(proxy.requests)
        assert [g["i"] for g in ds] == list(range(N))
        assert _range_gets(proxy, size) == ranged
        assert ds.source.stats.range_gets == 2 and len(proxy.requests) == before
        ds.close()


def test_items_collated_by_the_loader_read_only_its_first_batch_by_range(
    remote, written, objstore, tmp_path
):
    """Items one by one into a loader's batches of 4: the round of range reads is for the
    first batch alone (nothing is handed out before its last item), not for as many
    items as the byte budget holds (9 here): those would hold the chunks back longer."""
    name, size, first = _first_chunk(written)
    view = ChunkView((written / name).read_bytes(), name)
    with FaultProxy(objstore.endpoint_url) as proxy:
        proxy.add_fault(Fault("slow", path=name, range=f"bytes=0-{size - 1}", stall_s=1.0))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(remote, options, tmp_path, batch_size=4)
        got = [b["i"].clone() for b in DataLoader(ds, batch_size=4)]
        assert proxy.fired("slow") == 1
        ranged = _range_gets(proxy, size)
        ds.close()
    assert ranged == [
        (name, f"bytes=0-{items_start(PER_CHUNK) - 1}"),
        (name, f"bytes={first}-{view.span(3)[1] - 1}"),  # items 0-3, one range
    ], ranged
    assert [k for b in got for k in b.tolist()] == list(range(N))


def test_worker_first_batches_by_range_are_the_items(remote, written, objstore, tmp_path):
    _, size, _ = _first_chunk(written)
    chunks = N // PER_CHUNK
    with FaultProxy(objstore.endpoint_url) as proxy:
        # Every chunk waits: both workers' first items come by range.
        whole = f"bytes=0-{size - 1}"
        proxy.add_fault(Fault("slow", path=".bin", range=whole, stall_s=0.5, times=chunks))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(remote, options, tmp_path, shuffle=True, seed=5)
        batches = [
            (b["i"].clone(), b["x"].clone()) for b in DataLoader(ds, batch_size=8, num_workers=2)
        ]
        ranged = _range_gets(proxy, size)
        ds.close()
        assert proxy.fired("slow") == chunks  # each chunk downloaded once for the node
    # Per worker: one header per chunk of its first items, at most one range per item.
    assert 2 <= len(ranged) <= 2 * (chunks + EARLY // ITEM), ranged
    assert sorted(i for b, _ in batches for i in b.tolist()) == list(range(N))
    for i, x in batches:
        for k, row in zip(i.tolist(), x, strict=True):
            assert np.array_equal(row.numpy(), _item(k)["x"])


def test_a_loop_broken_after_its_first_items_fetches_nothing_to_check_them(
    remote, written, objstore, tmp_path
):
    """Range-read items were verified as they arrived: closing downloads no chunk (and
    waits for none) to check them."""
    name, size, _ = _first_chunk(written)
    with FaultProxy(objstore.endpoint_url) as proxy:
        proxy.add_fault(Fault("slow", path=name, range=f"bytes=0-{size - 1}", stall_s=2.0))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(remote, options, tmp_path)
        it = iter(ds)
        first = next(it)
        assert ds.source.stats.range_gets == 2 and first["i"] == 0  # read by range
        it.close()  # the loop breaks while the first chunk is still held back
        assert not ds.source.landed(0)
        ds.close()


def test_a_batch_reads_a_chunks_items_by_range_all_or_none(remote, objstore, tmp_path):
    """Items one by one take the budget item by item; a batch waits for its last item,
    so it reads a chunk's items by range only where all of them fit (else it would wait
    for that chunk anyway)."""
    ds = _dataset(remote, objstore.storage_options, tmp_path)
    r, idx = ds.reader, ds.index
    fit = EARLY // int(idx.bytes_per_chunk[0] // idx.items_per_chunk[0])  # items with headers
    assert fit == 9
    chunks, positions = np.zeros(16, np.int64), np.arange(16)
    assert r._early_plan(chunks, positions) == {0: list(range(fit))}
    assert r._early_plan(chunks, positions, whole=True) == {}
    # Chunk 0's six fit, chunk 1's eight don't (6 + 8 > 9), chunk 2's three do.
    chunks = np.array([0] * 6 + [1] * 8 + [2] * 3)
    positions = np.array([*range(6), *range(8), *range(3)])
    assert r._early_plan(chunks, positions, whole=True) == {0: list(range(6)), 2: [0, 1, 2]}
    assert r._early_plan(chunks, positions) == {0: list(range(6)), 1: [0, 1, 2]}
    ds.close()


def test_a_first_batch_that_would_wait_for_its_chunk_is_assembled_from_it(
    remote, written, objstore, tmp_path
):
    """16 items of the held-back first chunk, over the budget of 10: none is read by range,
    and the batch is assembled from the chunk (not collated item by item)."""
    from asynccache import CacheDataLoader

    name, size, _ = _first_chunk(written)
    with FaultProxy(objstore.endpoint_url) as proxy:
        proxy.add_fault(Fault("slow", path=name, range=f"bytes=0-{size - 1}", stall_s=0.5))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(remote, options, tmp_path)
        got = [(b["i"].clone(), b["x"].clone()) for b in CacheDataLoader(ds, batch_size=16)]
        assert proxy.fired("slow") == 1
        assert _range_gets(proxy, size) == [] and ds.source.stats.range_gets == 0
        stats = ds.batch_stats()
        assert stats["assembled"] == N // 16 and stats["collated"] == 0, stats
        ds.close()
    assert [k for i, _ in got for k in i.tolist()] == list(range(N))
    for i, x in got:
        for k, row in zip(i.tolist(), x, strict=True):
            assert np.array_equal(row.numpy(), _item(k)["x"])
