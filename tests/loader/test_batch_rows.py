"""Each live worker process has its own row of busy marks: two loaders iterating one
dataset at once never share a row, so neither reuses a buffer the consumer still holds."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.read.batchread import Form, Leaf
from asynccache.torch import batches
from tests.loader.test_batch import Fixed, N, write

FORM = Form(("leaf", 0), (Leaf("a", "|u1", (4,)),))


def owners(block: torch.Tensor) -> np.ndarray:
    return batches.table(block)[:, batches._OWNER]


def _row_in_child(block: torch.Tensor, token: str, out: Any) -> None:
    out.put(batches.Pool(block, token, 0).row)


def _child_row(block: torch.Tensor, token: str) -> int:
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_row_in_child, args=(block, token, q))
    p.start()
    row = q.get()
    p.join(timeout=60)
    assert p.exitcode == 0
    return int(row)


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("fixed"), Fixed(N))


def test_a_worker_of_a_second_live_loader_takes_another_row():
    """Worker 0 of a second loader while worker 0 of the first lives: another row (the
    bug: both used row 0, and one's batch freed cleared the other's busy mark). Once a
    row's owner is gone, its row is taken again."""
    block = batches.shared_bytes(batches.BLOCK_BYTES)
    first = batches.Pool(block, "t-rows", 0)  # this process plays the first loader's worker
    assert first.row == 0 and owners(block)[0] == os.getpid()
    assert _child_row(block, "t-rows") == 1  # the second loader's worker 0, alive
    assert _child_row(block, "t-rows") == 1  # another, after that one ended: its row again
    assert owners(block)[0] == os.getpid()


def test_a_row_lost_to_a_simultaneous_claim_is_left_with_the_batch_intact():
    """Two workers wrote the same row's owner at once and the other won: the loser sees it
    when it hands its next batch over. That batch comes out whole in a buffer of its own,
    the loser moves to another row, and the cell it marked keeps its mark (the winner's
    batch there, if any, stays busy)."""
    block = batches.shared_bytes(batches.BLOCK_BYTES)
    pool = batches.Pool(block, "t-lost", 3)
    slot, buf = pool.take(FORM.regions(2)[1])
    buf.numpy()[:8] = np.arange(8, dtype=np.uint8)
    owners(block)[3] = os.getppid()  # a live process claimed row 3 last
    got = pool.send(FORM, 2, slot, buf)
    assert isinstance(got, torch.Tensor) and got.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert got.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert pool.row == 4 and owners(block)[4] == os.getpid()
    assert owners(block)[3] == os.getppid()
    assert batches.table(block)[3, slot] != 0  # the lost row's cell stays marked
    assert batches.counters(block)["unpooled_buffers"] == 1


def test_two_loaders_over_one_dataset_at_once(fixed):
    """Two loaders over one dataset, iterated together, every batch of one held and the
    other's dropped: each holds every item once, unchanged, and their four workers had
    four rows."""
    ds = StreamingDataset(fixed)
    a = CacheDataLoader(ds, batch_size=4, num_workers=2)
    b = CacheDataLoader(ds, batch_size=4, num_workers=2)
    held: list[Any] = []
    seen_b: list[int] = []
    for x, y in zip(a, b, strict=False):
        held.append(x)
        seen_b += y["y"].tolist()
        del x, y
    got = [v for batch in held for v in batch["y"].tolist()]
    assert sorted(got) == list(range(N))
    for batch in held:
        want = batch["y"].to(torch.float32)[:, None, None] + 0.25
        assert torch.equal(batch["x"], want.expand(-1, 4, 3))
        assert torch.equal(batch["t"], torch.arange(5, dtype=torch.int16) * batch["y"][:, None])
    rows = owners(ds.batch_marks)
    assert len({int(p) for p in rows[: batches.MAIN_ROW] if p}) == 4
