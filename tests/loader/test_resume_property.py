"""Stop anywhere in the first three epochs, resume in a fresh loader: exactly the plan.

A reference run iterates epochs 0, 1 and 2 without stopping. An interrupted run takes a
checkpoint after ``k`` batches of epoch ``e`` (``k = 0``: after ``iter()``, before the
first batch; ``k`` = the epoch's batch count: after its last batch) and stops. A fresh
loader loads the checkpoint and runs until epoch 2 is done. The items received before
the stop followed by those received after it must be the reference's items, in order:
nothing repeated, nothing skipped, no empty epoch in between.

Several ranks are simulated in one process with ``RANK``/``WORLD_SIZE`` (what a
launcher sets), one loader per rank, run one after another; a real process group is
exercised in ``tests/distributed``. The writing epoch (the first epoch over a map-style
dataset, which writes the cache) runs with one rank: its ranks meet at the merge.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader
from asynccache.torch.fetcher import Fetcher
from tests.loader.datasets import DictDataset

EPOCHS = 3
CHUNK = 5  # items per chunk: several chunks even for small datasets
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Written datasets by size (reused across examples) and fresh directories."""
    written: dict[int, Path] = {}

    class Dirs:
        @staticmethod
        def written(n: int) -> Path:
            if n not in written:
                path = tmp_path_factory.mktemp(f"written{n}")
                list(CacheDataLoader(DictDataset(n), cache_dir=path, chunk_size=CHUNK))
                written[n] = path
            return written[n]

        @staticmethod
        def fresh() -> Path:
            return tmp_path_factory.mktemp("writing")

    return Dirs


@contextlib.contextmanager
def as_rank(rank: int, world: int) -> Iterator[None]:
    """Run as ``rank`` of ``world`` (no process group: the launcher's variables)."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    else:
        for k in saved:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make(path: Path, cfg: dict[str, Any]) -> CacheDataLoader:
    common = {
        "batch_size": cfg["bs"],
        "num_workers": cfg["workers"],
        "shuffle": cfg["shuffle"],
        "seed": 11,
        "drop_last": cfg["drop_last"],
    }
    if cfg["writing"]:  # epoch 0 reads the dataset and writes the cache
        return CacheDataLoader(DictDataset(cfg["n"]), cache_dir=path, chunk_size=CHUNK, **common)
    return CacheDataLoader(str(path), **common)  # every epoch streams the written cache


def keys(batch: Any) -> list[int]:
    return batch["i"].tolist()


def reference(path: Path, cfg: dict[str, Any]) -> list[list[int]]:
    """Each epoch's items, uninterrupted."""
    dl = make(path, cfg)
    return [[k for b in dl for k in keys(b)] for _ in range(EPOCHS)]


def take(it: Any, limit: int | None) -> Iterator[Any]:
    """Up to ``limit`` (None: all) more batches of ``it``, without calling ``iter()`` again."""
    count = 0
    while limit is None or count < limit:
        try:
            batch = next(it)
        except StopIteration:
            return
        count += 1
        yield batch


def interrupted(
    path: Path, cfg: dict[str, Any], stop_epoch: int, stop_batch: int, finish: bool
) -> tuple[list[int], Any]:
    """Items received up to the stop, and the checkpoint taken there.

    With ``finish`` the run goes on to the end of the epoch after the checkpoint (so a
    writing epoch merges its cache), as a run that crashes later would.
    """
    dl = make(path, cfg)
    got: list[int] = []
    source: Any = Fetcher(dl, prefetch_batches=2) if cfg["fetcher"] else dl
    try:
        for epoch in range(stop_epoch + 1):
            it = iter(source)  # a Fetcher returns itself: iterate `it` with next() only
            limit = stop_batch if epoch == stop_epoch else None
            got += [k for b in take(it, limit) for k in keys(b)]
            if epoch == stop_epoch:
                state = pickle.loads(pickle.dumps(source.state_dict()))
                if finish:
                    list(take(it, None))
                elif not cfg["fetcher"]:
                    it.close()  # the process "dies": its writers never finish
        return got, state
    finally:
        if cfg["fetcher"]:
            source.close()


def resumed(path: Path, cfg: dict[str, Any], state: Any) -> tuple[int, list[int]]:
    """The first epoch the resumed loader runs, and every item it yields up to epoch 2."""
    dl = make(path, cfg)
    source: Any = Fetcher(dl, prefetch_batches=2) if cfg["fetcher"] else dl
    source.load_state_dict(state)
    first = dl.epoch
    got: list[int] = []
    try:
        while dl.epoch < EPOCHS:
            got += [k for b in source for k in keys(b)]
        return first, got
    finally:
        if cfg["fetcher"]:
            source.close()


def check(
    dirs: Any,
    n: int,
    bs: int,
    drop_last: bool,
    workers: int,
    world: int,
    shuffle: bool,
    writing: bool,
    fetcher: bool,
    stop_epoch: int,
    stop_batch: int,
    finish: bool,
) -> None:
    if writing:
        world = 1  # the ranks of a writing epoch meet at the merge: see tests/distributed
    cfg = {
        "n": n,
        "bs": bs,
        "drop_last": drop_last,
        "workers": workers,
        "shuffle": shuffle,
        "writing": writing,
        "fetcher": fetcher,
    }
    states = []
    for rank in range(world):
        # Written as a single process (outside the simulated ranks, which never merge).
        ref_dir, run_dir = (dirs.fresh(), dirs.fresh()) if writing else (dirs.written(n),) * 2
        with as_rank(rank, world):
            ref = reference(ref_dir, cfg)
            batches = -(-len(ref[stop_epoch]) // bs)  # drop_last: ref has full ones only
            k = min(stop_batch, batches)
            before, state = interrupted(run_dir, cfg, stop_epoch, k, finish and writing)
            states.append(state)
            # Under DDP one rank's checkpoint resumes every rank: the state is the same.
            assert state == states[0]
            first, after = resumed(run_dir, cfg, states[0])
            whole = [k for epoch in ref for k in epoch]
            done = sum(len(e) for e in ref[:stop_epoch]) + k * bs
            assert before == whole[: len(before)], "the interrupted run follows the plan"
            assert len(before) == min(done, sum(len(e) for e in ref[: stop_epoch + 1]))
            assert before + after == whole, (
                f"rank {rank}: {len(before)} items before the stop + {len(after)} after "
                f"differ from the uninterrupted {len(whole)}"
            )
            assert first == (stop_epoch + 1 if k == batches else stop_epoch), (
                "a checkpoint after an epoch's last batch resumes with the next epoch"
            )


NS = st.integers(0, 40)
BS = st.integers(1, 8)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    n=NS,
    bs=BS,
    drop_last=st.booleans(),
    workers=st.just(0),
    world=st.sampled_from([1, 2, 3]),
    shuffle=st.booleans(),
    writing=st.booleans(),
    fetcher=st.booleans(),
    stop_epoch=st.integers(0, EPOCHS - 1),
    stop_batch=st.integers(0, 12),
    finish=st.booleans(),
)
# Epoch >= 1, checkpoint between iter() and the first batch (plain and through a Fetcher).
@example(23, 4, False, 0, 1, True, False, False, 1, 0, False)
@example(23, 4, False, 0, 1, True, False, True, 1, 0, False)
@example(23, 4, False, 0, 1, True, True, True, 1, 0, False)
# drop_last: a checkpoint after the last full batch continues with the next epoch.
@example(10, 4, True, 0, 1, False, False, False, 0, 99, False)
@example(10, 4, True, 0, 1, True, False, True, 1, 99, False)
@example(10, 4, True, 0, 1, True, True, False, 0, 99, True)
@example(10, 4, True, 0, 1, True, True, False, 0, 99, False)
# A writing-epoch checkpoint loaded after that epoch merged: the rest of its order.
@example(29, 3, False, 0, 1, True, True, False, 0, 4, True)
@example(29, 3, True, 0, 1, True, True, True, 0, 4, True)
@example(29, 3, False, 0, 1, True, True, False, 0, 0, True)
@example(29, 3, False, 0, 1, False, True, False, 0, 99, True)
# A writing-epoch checkpoint after its last batch, its cache never merged.
@example(29, 3, False, 0, 1, True, True, False, 0, 99, False)
# Several ranks; an epoch shorter than a batch; an empty dataset.
@example(37, 4, False, 0, 3, True, False, True, 2, 99, False)
@example(37, 4, True, 0, 2, True, False, False, 1, 3, False)
@example(3, 8, True, 0, 1, True, True, False, 0, 0, True)
@example(0, 2, False, 0, 1, False, True, True, 1, 0, False)
def test_resume_anywhere_is_exact(
    dirs,
    n,
    bs,
    drop_last,
    workers,
    world,
    shuffle,
    writing,
    fetcher,
    stop_epoch,
    stop_batch,
    finish,
):
    check(dirs, n, bs, drop_last, workers, world, shuffle, writing, fetcher, stop_epoch,
          stop_batch, finish)  # fmt: skip


@pytest.mark.parametrize(
    ("n", "bs", "drop_last", "world", "writing", "fetcher", "stop_epoch", "stop_batch", "finish"),
    [
        (31, 4, False, 1, True, True, 0, 3, True),  # writing checkpoint, merged before resume
        (31, 4, True, 1, True, False, 0, 99, False),  # after the last full batch, unmerged
        (31, 4, False, 2, False, True, 1, 0, False),  # epoch 1 before its first batch
        (31, 3, True, 3, False, False, 2, 99, False),  # after the very last batch
    ],
)
def test_resume_anywhere_with_worker_processes(
    dirs, n, bs, drop_last, world, writing, fetcher, stop_epoch, stop_batch, finish
):
    check(dirs, n, bs, drop_last, 2, world, True, writing, fetcher, stop_epoch, stop_batch,
          finish)  # fmt: skip
