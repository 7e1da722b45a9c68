"""The node's read plan over units that may run into the next chunk (token blocks): a
reader's runs cover every chunk a unit touches, so reading one does not jump its place."""

from __future__ import annotations

import numpy as np

from asynccache.readplan import union_runs
from asynccache.sampling.partition import Segment
from asynccache.sampling.runs import reader_runs


def test_runs_of_start_and_last_chunks_are_joined():
    # 10 units; unit u starts in chunk u // 3 and the last unit of each chunk runs into
    # the next one
    starts = lambda u: np.asarray(u) // 3  # noqa: E731
    lasts = lambda u: np.minimum((np.asarray(u) + 1) // 3, 3)  # noqa: E731
    keys = lambda a, b: np.arange(a, b)  # noqa: E731
    segs = [Segment(0, 10)]
    a, b = reader_runs(segs, keys, starts), reader_runs(segs, keys, lasts)
    runs = union_runs(a, b)
    got = list(zip(runs.chunks.tolist(), runs.starts.tolist(), runs.ends.tolist(), strict=True))
    # chunk 1 is needed from position 2 (unit 2 runs into it) to 6, not from 3
    assert got == [(0, 0, 3), (1, 2, 6), (2, 5, 9), (3, 8, 10)]
    assert runs.length == 10
    assert union_runs(a, a).chunks.tolist() == a.chunks.tolist()
