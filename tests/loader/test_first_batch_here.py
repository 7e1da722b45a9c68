"""The first batch of an epoch built in the main process while the workers start.

CacheDataLoader (whole batches from the workers, ``num_workers > 0``) builds an epoch's
first batch itself and its workers start after that batch, as a loader resumed from the
state after one batch does. These tests hold it to the plain run (every batch made by a
worker, ``first_batch_here=False``): the same batches bit for bit, the same states at
every stop, resumed anywhere; range-read items compared with their chunks.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from asynccache import CacheDataLoader, Fetcher, StreamingDataset, WorkerStartError
from asynccache.config import Settings
from asynccache.format import ChunkView
from asynccache.testing.faults import Fault, FaultProxy
from tests.helpers import noise_item, uploaded, write_noise_dataset
from tests.loader.test_batch import Fixed, same, write

pytestmark = pytest.mark.timeout(180)

EPOCHS = 2
N, PER_CHUNK, ITEM = 64, 16, 80 << 10  # chunks of 1.25 MiB: range reads start at 1 MiB
# Batches of 4: a worker's first batch (by range) leaves items of the main process's
# chunks to read from the chunks, which so land in the cache and are compared.
BS = 4


def _item(i: int) -> dict[str, Any]:
    return noise_item(i, ITEM)


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("fixed"), Fixed(23))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_noise_dataset(tmp_path_factory.mktemp("lead") / "src", N, PER_CHUNK, ITEM)


@pytest.fixture(scope="module")
def remote(written: Path, objstore: Any) -> Any:
    with uploaded(written, objstore, "lead") as url:
        yield url


def _chunk(src: Path, k: int) -> tuple[str, int, int]:
    """Name, size and first item offset of chunk ``k``."""
    name = sorted(f for f in os.listdir(src) if f.endswith(".bin"))[k]
    data = (src / name).read_bytes()
    return name, len(data), ChunkView(data, name).span(0)[0]


def _ds(
    url: Any, here: bool, shuffle: bool = False, start_s: float | None = None, **kw: Any
) -> StreamingDataset:
    s = Settings.from_env(progress=False, first_batch_here=here, worker_start_s=start_s)
    return StreamingDataset(url, shuffle=shuffle, seed=5, settings=s, **kw)


# -- a cold cache: the first batch by range, in the main process ------------------------
@pytest.mark.parametrize("shuffle", [False, True])
def test_cold_first_batch_by_range_is_the_plain_runs(remote, written, objstore, tmp_path, shuffle):
    _, size, _ = _chunk(written, 0)
    with FaultProxy(objstore.endpoint_url) as proxy:
        # Whole chunks wait, so the first batch surely comes by range.
        whole = f"bytes=0-{size - 1}"
        proxy.add_fault(Fault("slow", path=".bin", range=whole, stall_s=0.3, times=100))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        runs = {}
        for here in (True, False):
            ds = _ds(
                remote, here, shuffle, cache_dir=tmp_path / f"c{here}", storage_options=options
            )
            dl = CacheDataLoader(ds, batch_size=BS, num_workers=2)
            runs[here] = ([{k: v.clone() for k, v in b.items()} for b in dl], ds)
        assert proxy.fired("slow") >= 1
    (got, ds), (ref, plain) = runs[True], runs[False]
    assert ds.lead_stats.epochs == 1 and plain.lead_stats.epochs == 0
    # The main process read the first batch's items by range (each verified on arrival).
    assert ds.source.stats.range_gets > 0
    assert len(got) == len(ref) == N // BS
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    assert sorted(i for b in got for i in b["i"].tolist()) == list(range(N))
    for b in got[:1]:
        for k, row in zip(b["i"].tolist(), b["x"], strict=True):
            assert np.array_equal(row.numpy(), _item(k)["x"])
    ds.close()
    plain.close()
    # Warm (every chunk in the cache now): built from the mapped chunks, no range read.
    opts = objstore.storage_options
    warm = _ds(remote, True, shuffle, cache_dir=tmp_path / "cTrue", storage_options=opts)
    again = list(CacheDataLoader(warm, batch_size=BS, num_workers=2))
    assert warm.lead_stats.epochs == 1 and warm.source.stats.range_gets == 0
    assert warm.source.stats.chunks_fetched == 0
    for a, b in zip(again, ref, strict=True):
        same(a, b)
    warm.close()


def test_a_damaged_range_of_the_first_batch_is_fetched_again(remote, written, objstore, tmp_path):
    """The main process's range read of the first batch is verified on arrival: the
    damaged response is fetched again, and no batch holds a damaged item."""
    name, size, first = _chunk(written, 0)
    with FaultProxy(objstore.endpoint_url) as proxy:
        proxy.add_fault(Fault("slow", path=name, range=f"bytes=0-{size - 1}", stall_s=0.5))
        # A byte of item 0 flipped in its range read (item 0 is in the main's batch only).
        proxy.add_fault(Fault("flip", path=name, range=f"bytes={first}-", flip_at=ITEM // 2))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _ds(remote, True, cache_dir=tmp_path / "c", storage_options=options)
        got = [{k: v.clone() for k, v in b.items()} for b in CacheDataLoader(ds, BS, num_workers=2)]
        assert proxy.fired("flip") == 1 and ds.lead_stats.epochs == 1
        assert ds.source.stats.retries >= 1
        ds.close()
    assert sorted(i for b in got for i in b["i"].tolist()) == list(range(N))
    for b in got:
        for k, row in zip(b["i"].tolist(), b["x"], strict=True):
            assert np.array_equal(row.numpy(), _item(k)["x"]), k


# -- resume: the same states and batches as the plain run, stopped anywhere ---------------
def _keys(batch: Any) -> list[int]:
    return batch["y"].tolist()


def _run(path: Path, cfg: dict[str, Any], here: bool, stop: int) -> tuple[list[int], Any, int]:
    """Items of ``stop`` batches, the state there, then the items of a fresh loader resumed
    from it up to the end of epoch ``EPOCHS - 1``; and the main-built first batches."""
    kw = {"batch_size": cfg["bs"], "drop_last": cfg["drop_last"], "num_workers": 2}
    ds = _ds(path, here, cfg["shuffle"])
    dl = CacheDataLoader(ds, **kw)
    it = iter(dl)
    got: list[int] = []
    for _ in range(stop):
        got += _keys(next(it))
    state = pickle.loads(pickle.dumps(dl.state_dict()))
    del it
    again_ds = _ds(path, here, cfg["shuffle"])
    again = CacheDataLoader(again_ds, **kw)
    again.load_state_dict(state)
    while again.epoch < EPOCHS:
        got += [k for b in again for k in _keys(b)]
    assert dl.batch_fallback is None
    return got, state, ds.lead_stats.epochs + again_ds.lead_stats.epochs


@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    bs=st.integers(2, 7),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    stop=st.sampled_from(["0", "1", "last"]),
)
@example(bs=4, drop_last=False, shuffle=True, stop="0")
@example(bs=5, drop_last=True, shuffle=False, stop="1")
@example(bs=3, drop_last=False, shuffle=True, stop="last")
def test_states_and_batches_are_the_plain_runs(fixed, bs, drop_last, shuffle, stop):
    cfg = {"bs": bs, "drop_last": drop_last, "shuffle": shuffle}
    last = 23 // bs if drop_last else -(-23 // bs)
    at = {"0": 0, "1": 1, "last": last}[stop]
    got, state, led = _run(fixed, cfg, True, at)
    ref, ref_state, ref_led = _run(fixed, cfg, False, at)
    assert got == ref and state == ref_state
    assert ref_led == 0
    # Built here: the first batch of the loader stopped after `at`... (none when stopped
    # before asking for one), and of each epoch the resumed loader starts.
    assert led == (1 if at else 0) + EPOCHS - (1 if at == last else 0)


def test_persistent_workers_keep_the_order(fixed):
    """Only a loader's new workers start after a main-built batch: with persistent
    workers the later epochs come from the same workers, as in the plain run."""
    got = {}
    for here in (True, False):
        ds = _ds(fixed, here, True)
        dl = CacheDataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
        got[here] = ([k for _ in range(EPOCHS) for b in dl for k in _keys(b)], ds.lead_stats.epochs)
        del dl
    assert got[True][0] == got[False][0]
    assert sorted(got[True][0]) == sorted(list(range(23)) * EPOCHS)
    assert got[True][1] == 1 and got[False][1] == 0


def test_workers_started_after_a_led_epoch_read_whole_epochs(fixed):
    """Once the epoch whose first batch the main process built is over, nothing is handed
    out ahead any more: the workers of a plain DataLoader over the same dataset read
    the next epoch whole."""
    ds = _ds(fixed, True, True)
    assert sorted(k for b in CacheDataLoader(ds, batch_size=4, num_workers=2) for k in _keys(b))
    assert ds.lead_stats.epochs == 1 and ds._head == 0
    plain = DataLoader(ds, batch_size=None, num_workers=2)  # whole batches, as published
    assert sorted(k for b in plain for k in _keys(b)) == list(range(23))


# -- when the workers start ----------------------------------------------------------------
class _HeldProcess(ForkServerProcess):
    """A process started by the fork server whose start waits for ``release`` (at most
    30 s)."""

    release = threading.Event()

    def start(self) -> None:
        if not type(self).release.wait(30):
            raise RuntimeError("never released")
        super().start()


class _HeldServer(ForkServerContext):
    Process = _HeldProcess  # type: ignore[assignment]


def test_workers_that_do_not_start_in_time_raise_and_are_shut_down(
    remote, objstore, tmp_path, monkeypatch
):
    """Cold, workers that do not fork start in a thread after the batches built here; a
    start that outlasts its bound raises WorkerStartError at the next batch instead of
    waiting on forever, and workers that start after that are shut down."""
    monkeypatch.setattr(_HeldProcess, "release", threading.Event())
    before = {p.pid for p in multiprocessing.active_children()}
    ds = _ds(
        remote,
        True,
        start_s=0.5,  # ASYNCCACHE_WORKER_START_S
        cache_dir=tmp_path / "c",
        storage_options=objstore.storage_options,
    )
    dl = CacheDataLoader(ds, batch_size=BS, num_workers=2, multiprocessing_context=_HeldServer())
    it = iter(dl)
    got = [next(it), next(it)]  # the two built here (cold: by range)
    assert ds.lead_stats.epochs == 1 and ds.source.stats.range_gets > 0
    with pytest.raises(
        WorkerStartError, match=r"2 worker processes \(forkserver\) did not start within 0.5 s"
    ):
        next(it)
    _HeldProcess.release.set()
    deadline = time.monotonic() + 60
    while any(t.name == "asynccache-workers" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the thread starting the workers did not end"
        time.sleep(0.02)
    # The late workers were shut down at once: none of them is left.
    while {p.pid for p in multiprocessing.active_children()} - before:
        assert time.monotonic() < deadline, "the late workers were not shut down"
        time.sleep(0.02)
    assert len(got) == 2
    ds.close()


_FORKED_BY: list[str] = []  # the thread of each fork of this process, while recorded
os.register_at_fork(before=lambda: _FORKED_BY.append(threading.current_thread().name))
_STEP = threading.Lock()  # a lock of the consumer's, held through its step


def _init_takes_the_step_lock(worker_id: int) -> None:
    with _STEP:  # forked while the consumer held it: held in the child forever
        pass


@pytest.mark.parametrize("via", ["loop", "fetcher"])
def test_workers_fork_before_the_first_batch_is_handed_over(fixed, via):
    """Forked workers are forked by the thread that asks for the first batch, before it
    has it: a child forked while the consumer runs its step (a thread forking beside
    it) inherits every lock the step holds at that moment, torch's included, and waits
    for it forever. Here the step holds a lock of its own that each worker takes as it
    starts, through the first step a while: the epoch completes (torch's timeout bounds a
    worker that never answers). With a Fetcher its thread iterates, and forks while the
    step waits for the first batch."""
    ds = _ds(fixed, True, True)
    dl = CacheDataLoader(
        ds,
        batch_size=4,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=_init_takes_the_step_lock,
        timeout=30,
    )
    _FORKED_BY.clear()
    got: list[int] = []
    for b in dl if via == "loop" else Fetcher(dl):
        with _STEP:  # the step
            got += _keys(b)
            if len(got) == 4:
                time.sleep(0.5)  # the first step: long enough for any fork beside it
    forked_by = list(_FORKED_BY)
    assert sorted(got) == list(range(23))
    assert ds.lead_stats.epochs == 1  # the first batches were built here
    thread = threading.main_thread().name if via == "loop" else "asynccache-fetcher"
    assert forked_by == [thread] * 2, forked_by
