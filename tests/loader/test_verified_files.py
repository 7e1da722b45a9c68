"""A local dataset's chunks are hashed once for the dataset and all its DataLoader workers
(a table in shared memory, :mod:`asynccache.read.verified`), by the file: each epoch's
new workers hash nothing again, and a file put at a chunk's path later is hashed again."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.errors import ChecksumMismatchError
from asynccache.read import reader as reader_mod
from asynccache.read.verified import ROW, VerifiedFiles
from tests.helpers import write_noise_dataset

pytestmark = pytest.mark.timeout(120)

N, PER_CHUNK = 48, 8  # 6 chunks


@pytest.fixture
def local(tmp_path) -> Path:
    return write_noise_dataset(tmp_path / "ds", N, PER_CHUNK, 512)


def _chunks(d: Path) -> list[str]:
    return sorted(p for p in os.listdir(d) if p.endswith(".bin"))


def _ident(path: Path) -> tuple[int, int, int, int, int]:
    st_ = os.stat(path)
    return (st_.st_dev, st_.st_ino, st_.st_size, st_.st_mtime_ns, st_.st_ctime_ns)


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_the_workers_verified_files_are_the_datasets(local, context):
    ds = StreamingDataset(str(local), shuffle=True, seed=3)
    loader = CacheDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    got = sorted(int(i) for b in loader for i in b["i"])
    assert got == list(range(N))
    table = ds.reader.shared_verified
    assert table is not None
    for ci, name in enumerate(_chunks(local)):
        assert table.holds(ci, _ident(local / name)), name  # by the dataset or a worker
    # Another file at a chunk's path (the next chunk's bytes, a valid chunk of the same
    # size): the next epoch's workers hash it, and refuse it.
    first, second = _chunks(local)[:2]
    tmp = local / "replacement.tmp"
    tmp.write_bytes((local / second).read_bytes())
    os.replace(tmp, local / first)
    assert not table.holds(0, _ident(local / first))
    with pytest.raises(ChecksumMismatchError, match=first):
        list(loader)


def test_each_epochs_new_workers_hash_nothing_again(local, tmp_path, monkeypatch):
    """Forked workers (they inherit the counting hash): the first epoch hashes each chunk
    once, the next ones none."""
    log = tmp_path / "hashed"
    real = reader_mod.checksum

    def counting(mm):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(mm)

    monkeypatch.setattr(reader_mod, "checksum", counting)
    ds = StreamingDataset(str(local), shuffle=True, seed=3)
    loader = CacheDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    counts = []
    for _ in range(3):
        assert sorted(int(i) for b in loader for i in b["i"]) == list(range(N))
        counts.append(len(log.read_text().split()) if log.exists() else 0)
    n = len(_chunks(local))
    # Each chunk at most once per worker that raced for it in the first epoch; none after.
    assert n <= counts[0] <= 2 * n and counts[1] == counts[0] and counts[2] == counts[0]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 8),
    ops=st.lists(
        st.tuples(
            st.integers(0, 20), st.lists(st.integers(-(2**63), 2**63 - 1), min_size=5, max_size=5)
        ),
        max_size=30,
    ),
)
def test_the_table_holds_only_what_was_put_last_in_a_row(rows, ops):
    """Against a dict of the last file put for each row: a chunk is held only with the
    file put for it last, and only while no other chunk took its row."""
    view = np.zeros(rows * ROW * 8, np.uint8)
    table = VerifiedFiles(view, lambda v: v)
    last: dict[int, tuple[int, tuple[int, ...]]] = {}
    for ci, ident in ops:
        table.put(ci, tuple(ident))
        last[ci % rows] = (ci, tuple(ident))
        for ci2, ident2 in ops:
            want = last.get(ci2 % rows) == (ci2, tuple(ident2))
            assert table.holds(ci2, tuple(ident2)) == want
