"""The first batches of an epoch built in the main process, one per worker it stands in for.

``CacheDataLoader`` builds the first two batches of a streamed epoch itself (each the first
batch of a different DataLoader worker), their items read by range in one round, and the
workers start after them. Then no worker reads anything by range, not even one whose
first batch was not built there (a third worker, or the second of a shuffled cold start):
their chunks start downloading at once. A mix's first batches are built there too, from
cached chunks. Bit-for-bit equality with the plain run and resume of one dataset
are in ``test_first_batch_here.py``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import uuid
from typing import Any

import numpy as np
import pytest

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.config import Settings
from asynccache.format.chunk import items_start
from asynccache.testing.faults import FaultProxy
from asynccache.write.writer import ChunkWriter, merge_dir
from tests.loader.mix_data import mix, pairs, write_streams
from tests.remote_data import upload_dataset

pytestmark = pytest.mark.timeout(120)

N, PER_CHUNK, ITEM = 64, 16, 80 << 10  # chunks of 1.25 MiB: range reads start at 1 MiB
BS = 4


def _item(i: int) -> dict[str, Any]:
    return {"i": i, "x": np.random.default_rng(i).integers(0, 256, ITEM, dtype=np.uint8)}


def _uploaded(
    tmp_path_factory: pytest.TempPathFactory, objstore: Any, tag: str, n: int, writers: int = 1
) -> Any:
    """Items ``_item(0..n-1)`` in chunks of PER_CHUNK, in a bucket of their own (removed
    after the module); ``writers`` write consecutive equal shares, each its own chunks."""
    src = tmp_path_factory.mktemp(tag) / "src"
    share = n // writers
    for r in range(writers):
        w = ChunkWriter(str(src), r, chunk_size=PER_CHUNK)
        for i in range(r * share, n if r == writers - 1 else (r + 1) * share):
            w.add(i, _item(i))
        w.finish()
    merge_dir(str(src), list(range(writers)))
    bucket = f"{tag}-{uuid.uuid4().hex[:12]}"
    objstore.create_bucket(bucket)
    yield upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)
    with contextlib.suppress(Exception):
        objstore.delete_bucket(bucket)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory, objstore: Any) -> Any:
    yield from _uploaded(tmp_path_factory, objstore, "lead2", N)


def _header_gets(proxy: FaultProxy) -> collections.Counter[str]:
    """The GETs of a chunk's header by range, per object path."""
    header = f"bytes=0-{items_start(PER_CHUNK) - 1}"
    return collections.Counter(
        r.path for r in proxy.requests if r.method == "GET" and r.range == header
    )


def test_no_worker_reads_by_range_after_the_first_batches_built_here(remote, objstore, tmp_path):
    workers = 3  # two first batches built here; the third worker's from its chunks
    with FaultProxy(objstore.endpoint_url) as proxy:
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        settings = Settings.from_env(progress=False)
        ds = StreamingDataset(
            remote, cache_dir=tmp_path / "c", storage_options=options, settings=settings
        )
        got = [
            {k: v.clone() for k, v in b.items()}
            for b in CacheDataLoader(ds, batch_size=BS, num_workers=workers)
        ]
        per_chunk = _header_gets(proxy)
    assert (
        ds.lead_stats.epochs == 1 and ds.lead_stats.batches == 2
    )  # the first two batches, built here
    assert sorted(i for b in got for i in b["i"].tolist()) == list(range(N))
    for b in got[:2]:
        for k, row in zip(b["i"].tolist(), b["x"], strict=True):
            assert np.array_equal(row.numpy(), _item(k)["x"])
    # The main process read the headers of the chunks of the two batches it built, in one
    # round, before any worker started, and no worker read a header (before, the first
    # batch's worker read its second batch by range too, asking for its chunk's header a
    # second time; and the third worker read its own first batch by range, unless its
    # chunk had landed).
    led = {ds.index.filename(i // PER_CHUNK) for b in got[:2] for i in b["i"].tolist()}
    assert ds.source.stats.range_gets > 0
    assert max(per_chunk.values()) == 1, per_chunk
    assert {name for name in led if any(p.endswith(name) for p in per_chunk)} == led
    assert len(per_chunk) == len(led), (per_chunk, led)
    ds.close()


def test_the_second_worker_of_a_shuffled_cold_start_reads_nothing_by_range(
    remote, objstore, tmp_path
):
    # Shuffled and cold, each item of a first batch is a GET of its own: the first batch
    # is built here alone. The second comes from worker 1's chunks, which start
    # downloading as the worker starts. Read by range there, its items (a GET each, and a
    # header each for a window of chunks) held worker 1's chunk downloads back until they
    # came, and on two cores took the CPU the downloads needed: the epoch of 512 MiB in
    # 64 MiB chunks ran in 0.76-0.90 s against 0.68-0.76 (docs/performance.md).
    with FaultProxy(objstore.endpoint_url) as proxy:
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = StreamingDataset(
            remote,
            cache_dir=tmp_path / "c",
            storage_options=options,
            settings=Settings.from_env(progress=False),
            shuffle=True,
            seed=3,
            shuffle_window=2,
        )
        got = [b["i"].tolist() for b in CacheDataLoader(ds, batch_size=BS, num_workers=2)]
        per_chunk = _header_gets(proxy)
    assert ds.lead_stats.epochs == 1 and ds.lead_stats.batches == 1  # built alone
    assert sorted(i for b in got for i in b) == list(range(N))
    led = {ds.index.filename(i // PER_CHUNK) for i in got[0]}
    second = {ds.index.filename(i // PER_CHUNK) for i in got[1]}
    assert second - led, "the second batch drew only from the first's chunks: proves nothing"
    assert ds.source.stats.range_gets > 0  # the first batch's
    # Only the first batch's chunks had their headers read by range.
    assert {p.rsplit("/", 1)[-1] for p in per_chunk} == led, (per_chunk, led)
    ds.close()


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_node_s_plan_is_made_once_for_the_forked_workers(
    remote, objstore, tmp_path, monkeypatch, shuffle
):
    """Each worker planned every reader of its node (the eviction follows the node's plan):
    8 workers on two cores made 64 reader plans an epoch, 8 times one's. The main process
    now makes the node's plan of the epoch and the next before it forks the workers, which
    inherit it and plan nothing; the epoch reads as before."""
    from asynccache.read import readplan

    log = tmp_path / "builds"
    real = readplan.PlanCache._build

    def build(self: Any, epoch: int, *a: Any) -> Any:
        with open(log, "a") as f:  # (one short write each: appends do not interleave)
            f.write(f"{os.getpid()} {epoch}\n")
        return real(self, epoch, *a)

    monkeypatch.setattr(readplan.PlanCache, "_build", build)  # (forked workers inherit it)
    ds = StreamingDataset(
        remote,
        cache_dir=tmp_path / "c",
        storage_options=objstore.storage_options,
        settings=Settings.from_env(progress=False),
        shuffle=shuffle,
    )
    dl = CacheDataLoader(ds, batch_size=BS, num_workers=3, multiprocessing_context="fork")
    for epoch in range(2):
        log.write_text("")
        got = sorted(i for b in dl for i in b["i"].tolist())
        assert got == list(range(N))
        assert ds.lead_stats.epochs == epoch + 1  # (the plan is made where batches are led)
        builds = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
        # Here only (a shuffled epoch's window is fitted to the budget here too, from plans
        # of its own), each at most once per epoch of the two.
        assert {pid for pid, _ in builds} == {os.getpid()}, builds
        assert {e for _, e in builds} <= {epoch, epoch + 1}
        assert len(builds) <= (4 if shuffle else 2), builds
    ds.close()


# -- small chunks: a writer's remainder ------------------------------------------------
SMALL_N = N + 2  # the last chunk holds 2 items (160 KiB): under the 1 MiB of range reads


@pytest.fixture(scope="module")
def small_tail(tmp_path_factory: pytest.TempPathFactory, objstore: Any) -> Any:
    yield from _uploaded(tmp_path_factory, objstore, "leadtail", SMALL_N)


@pytest.fixture(scope="module")
def small_within(tmp_path_factory: pytest.TempPathFactory, objstore: Any) -> Any:
    # Two writers of 33 items each: chunks of 16, 16, 1 | 16, 16, 1 (items 32 and 65 in
    # the small ones, one of them amid the index).
    yield from _uploaded(tmp_path_factory, objstore, "leadwithin", SMALL_N, writers=2)


@pytest.mark.parametrize(
    ("layout", "small_items"), [("small_tail", {N, N + 1}), ("small_within", {N // 2, N + 1})]
)
def test_a_shuffled_first_batch_drawing_from_a_small_chunk_is_built_here(
    layout, small_items, objstore, tmp_path, request
) -> None:
    # A chunk under 1 MiB is downloaded whole rather than read by range; a shuffled first
    # batch that drew one of its items used not to be built in the main process at all
    # (it would have downloaded that chunk there), and came from a worker instead. A
    # dataset written by several writers has such a chunk per writer, not only last.
    url = request.getfixturevalue(layout)
    settings = Settings.from_env(progress=False)
    drew_small = 0
    for seed in range(12):
        ds = StreamingDataset(
            url,
            cache_dir=tmp_path / f"c{seed}",
            storage_options=objstore.storage_options,
            settings=settings,
            shuffle=True,
            seed=seed,
            shuffle_window=2,
        )
        assert sorted(int(ds.index.items_per_chunk[c]) for c in range(ds.index.num_chunks))[:2] == (
            [1, 1] if layout == "small_within" else [2, 16]
        )
        it = iter(CacheDataLoader(ds, batch_size=BS, num_workers=2))
        batch = next(it)
        del it
        built_here = ds.lead_stats.epochs
        ds.close()
        first = batch["i"].tolist()
        drew_small += any(i in small_items for i in first)
        assert built_here == 1, (seed, first)
        for k, row in zip(first, batch["x"], strict=True):
            assert np.array_equal(row.numpy(), _item(k)["x"])
    assert drew_small > 0, "no first batch drew from a small chunk: the test proves nothing"


# -- a mix: its first batches built here from cached chunks ------------------------------
@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_streams(str(tmp_path_factory.mktemp("mixlead")))


def test_a_mix_s_first_batches_built_here_are_the_plain_runs(streams):
    """A mix's first batches, built in the main process from cached chunks: the batches,
    the state after the first and its resumed continuation are the plain run's."""
    runs, mode = {}, "stratified"
    for here in (True, False):
        kw = {"stream_kw": {"settings": Settings.from_env(progress=False, first_batch_here=here)}}
        ds = mix(streams, mode, batch_size=8, **kw)
        dl = CacheDataLoader(ds, batch_size=8, num_workers=2)
        it = iter(dl)
        first = [next(it)]
        state = dl.state_dict()
        del it
        again_ds = mix(streams, mode, batch_size=8, **kw)
        again = CacheDataLoader(again_ds, batch_size=8, num_workers=2)
        again.load_state_dict(state)
        rest = list(again)
        runs[here] = (pairs(first), pairs(rest), state, ds, again_ds, dl.batch_fallback)
    (f, r, state, ds, again_ds, fallback), (pf, pr, pstate, plain, _, _) = runs[True], runs[False]
    assert fallback is None  # whole batches from the workers
    assert (
        ds.lead_stats.epochs == 1
        and again_ds.lead_stats.epochs == 1
        and plain.lead_stats.epochs == 0
    )
    assert ds.lead_stats.batches >= 1 and again_ds.lead_stats.batches == 2
    assert f == pf and state == pstate and r == pr
    assert len(f) + len(r) == sum(ds.stream_counts)


# -- the workers' start -------------------------------------------------------------------
def _start_order(ds: StreamingDataset, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run one epoch of ``ds`` with 2 workers; the order in which the lead batches were
    built ("built") and the workers' DataLoader was started ("workers"). The workers'
    start waits for the built batches a minute, not 0.15 s: only the link can cut it short.
    """
    from torch.utils.data import DataLoader

    from asynccache.torch import workers

    monkeypatch.setattr(workers, "_START_AFTER_S", 60.0)
    events: list[str] = []
    build, start = StreamingDataset._lead_batch, DataLoader.__iter__

    def built(self: StreamingDataset, keys: Any) -> Any:
        out = build(self, keys)
        events.append("built")
        return out

    def started(self: DataLoader, *a: Any, **kw: Any) -> Any:
        events.append("workers")
        return start(self, *a, **kw)

    monkeypatch.setattr(StreamingDataset, "_lead_batch", built)
    monkeypatch.setattr(DataLoader, "__iter__", started)
    got = [int(i) for b in CacheDataLoader(ds, batch_size=BS, num_workers=2) for i in b["i"]]
    assert sorted(got) == list(range(N))
    return events


def test_workers_start_beside_the_first_batches_on_a_far_link(
    remote, objstore, tmp_path, monkeypatch
) -> None:
    settings = Settings.from_env(progress=False)
    # Near (loopback): the first byte in milliseconds, the batches are built on this CPU,
    # and the workers fork after them (a fork holds the interpreter lock).
    near = StreamingDataset(
        remote,
        cache_dir=tmp_path / "near",
        storage_options=objstore.storage_options,
        settings=settings,
    )
    assert not near._far_link()
    assert _start_order(near, monkeypatch) == ["built", "built", "workers"]
    assert near.lead_stats.batches == 2
    near.close()
    # Far (200 ms to every first byte, measured already on the index's column sidecar):
    # the batches wait on the network, and the workers start beside them at once.
    with FaultProxy(objstore.endpoint_url, latency_s=0.2) as proxy:
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        far = StreamingDataset(
            remote, cache_dir=tmp_path / "far", storage_options=options, settings=settings
        )
        assert far._far_link()
        assert _start_order(far, monkeypatch) == ["workers", "built", "built"]
        assert far.lead_stats.batches == 2
        assert proxy.link_fired("latency") > 0
        far.close()


def test_workers_fork_first_when_the_lead_batches_copy_cached_chunks(
    remote, objstore, tmp_path, monkeypatch
) -> None:
    """Lead batches read only from cached chunks and of ``_FORK_FIRST_BYTES`` or more are
    a copy that takes longer than the forks: the workers fork first, and their own first
    batches follow sooner. A cold lead (range reads on loopback) and a small one are built
    first, as before."""
    from asynccache.torch import streaming

    ds = StreamingDataset(
        remote,
        cache_dir=tmp_path / "c",
        storage_options=objstore.storage_options,
        settings=Settings.from_env(progress=False),
    )
    lead_bytes = 2 * BS * ITEM  # two batches of this dataset's items
    monkeypatch.setattr(streaming, "_FORK_FIRST_BYTES", lead_bytes)
    assert _start_order(ds, monkeypatch) == ["built", "built", "workers"]  # cold
    assert _start_order(ds, monkeypatch) == ["workers", "built", "built"]  # every chunk cached
    assert ds.lead_stats.batches == 4
    # The same cached lead under a bound twice its size (the lead's bytes are estimated
    # as each chunk's bytes over its items, headers included): built first.
    monkeypatch.setattr(streaming, "_FORK_FIRST_BYTES", 2 * lead_bytes)
    assert _start_order(ds, monkeypatch) == ["built", "built", "workers"]
    ds.close()
