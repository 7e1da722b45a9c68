"""A DataLoader worker counts the batches it makes on the busy-mark row it holds.

A worker prefers the row of its worker id, and takes another when a live process owns
that one (two loaders iterating one dataset at the same time). Its ``assembled`` /
``collated`` counters go to the row it holds, so two processes never add to one cell.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.torch import batches
from tests.loader.test_batch import Fixed, write

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("rows"), Fixed(12))


def test_a_worker_counts_on_the_row_it_holds(fixed):
    ds = StreamingDataset(fixed)
    rows = batches.table(ds.batch_marks)
    rows[0, batches._OWNER] = os.getpid()  # worker 0's row: held by a live process (this)
    got = list(CacheDataLoader(ds, batch_size=2, num_workers=1))
    assembled = rows[:, batches._COUNT + batches.COUNTERS.index("assembled")]
    lead = ds.lead_stats.batches  # built here, counted on the main process's row
    assert len(got) == 6 and lead == 1
    assert int(rows[1, batches._OWNER]) not in (0, os.getpid())  # the worker took row 1
    assert int(assembled[0]) == 0  # nothing on the row another process holds
    assert int(assembled[1]) == len(got) - lead
    assert int(assembled[batches.MAIN_ROW]) == lead
    assert ds.batch_stats()["assembled"] == len(got)
