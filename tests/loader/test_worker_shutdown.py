"""An epoch that ends by an error shuts its DataLoader workers down at once.

The error's traceback holds torch's DataLoader iterator (its frames have it as ``self``),
so a caller that keeps the error keeps the iterator and its workers. Left to the cycle
collector, that iterator can't stop them gracefully (the collector clears its queues'
weak references first, which ends their feeder threads), and torch waits 5 s for each
worker before killing it: a ``gc.collect()`` anywhere later took 11 s.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.config import Settings
from tests.loader.test_batch import Fixed, write

pytestmark = pytest.mark.timeout(120)


class Boom(Exception):
    pass


BAD = 21  # in neither of the first two batches (those the main process builds)


def _boom(item: Any) -> Any:
    if int(item["y"]) == BAD:
        raise Boom(f"item {BAD}")
    return item


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("fixed"), Fixed(23))


def _children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


@pytest.mark.parametrize("how", ["items", "lead", "one batch"])
def test_workers_end_with_an_epoch_that_raised_while_the_error_is_kept(fixed, how):
    """``items``: the DataLoader collates items (a per-item transform); ``lead``: whole
    batches, the first two built in the main process; ``one batch``: the epoch is a
    single batch, made by a worker (nothing built here)."""
    before = _children()
    s = Settings.from_env(progress=False)
    transform = _boom if how == "items" else None
    ds = StreamingDataset(fixed, transform=transform, settings=s)
    dl = CacheDataLoader(ds, batch_size=32 if how == "one batch" else 4, num_workers=2)
    if how != "items":
        build = ds._batch

        def failing(keys: Any, *a: Any, **kw: Any) -> Any:
            if BAD in keys.tolist():
                raise Boom(f"item {BAD}")
            return build(keys, *a, **kw)

        ds._batch = failing  # type: ignore[method-assign]  (copied into the workers)
    got = 0
    with pytest.raises(Boom) as err:
        for _ in dl:
            got += 1
    assert f"item {BAD}" in str(err.value)
    assert got >= (0 if how == "one batch" else 2)
    assert ds.lead_stats.epochs == (1 if how == "lead" else 0)
    # The error is kept (its traceback holds the DataLoader's iterator), yet no worker of
    # the epoch is left: they were told to stop when the error passed through.
    deadline = time.monotonic() + 30
    while _children() - before:
        assert time.monotonic() < deadline, f"workers still running: {_children() - before}"
        time.sleep(0.02)
    # And the collector finds nothing left to stop (no 5 s wait per worker).
    gc.collect()
    del err
