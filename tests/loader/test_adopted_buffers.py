"""Buffers outlive their worker (:mod:`asynccache.torch.batches`): a worker forked for a
new epoch writes into the buffers the consumer keeps mapped from the row's earlier owner,
never one the consumer still holds a batch in, and only the holder of the row's lock does.

Three levels: the adoption in one process (a pool made again on the same row, the
consumer's side in the same process), with a property over sends, holds, drops and new
pools; the row lock against a second process; and ``CacheDataLoader`` without persistent
workers over several epochs, under fork (adopted) and spawn (nothing to adopt).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import secrets
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing  # (registers torch's reductions with the pickler)
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.read.batchread import Form, Leaf
from asynccache.torch import batches
from tests.loader.test_batch import Fixed, N, per_item, same, write

ROW = 5
ROW_BYTES = 64 << 10
FORM = Form(("leaf", 0), (Leaf("a", "|u1", (ROW_BYTES,)),))
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the row lock is Linux's")


class Consumer:
    """A dataset's busy block, and pools on one row of it made one after another (each
    one an epoch's worker), received in this same process."""

    def __init__(self) -> None:
        self.block = batches.shared_bytes(batches.BLOCK_BYTES)
        self.token = secrets.token_hex(8)
        batches.register(self.token, self.block)
        self.pool: batches.Pool | None = batches.Pool(self.block, self.token, ROW)

    def new_worker(self) -> None:
        self.pool = None  # the earlier one ends (its lock with it)
        self.pool = batches.Pool(self.block, self.token, ROW)

    def send(self, value: int) -> torch.Tensor:
        assert self.pool is not None
        slot, buf = self.pool.take(FORM.regions(1)[1])
        buf.numpy()[:ROW_BYTES] = value
        return ForkingPickler.loads(ForkingPickler.dumps(self.pool.send(FORM, 1, slot, buf)))

    def counters(self) -> dict[str, int]:
        return batches.counters(self.block)


@linux
def test_a_new_pool_writes_into_the_free_buffers_and_leaves_the_held_one():
    c = Consumer()
    held = c.send(1)
    dropped = c.send(2)
    del dropped
    c.new_worker()
    assert c.counters()["adopted_buffers"] == 1, "the free buffer, not the held one"
    again = [c.send(v) for v in (3, 4, 5)]
    assert torch.all(held == 1), "the held batch is never written over"
    assert [int(b[0, 0]) for b in again] == [3, 4, 5]
    assert c.counters()["sent_buffers"] == 2 + 2, "the adopted one is not sent again"


@linux
def test_an_adopted_buffer_is_populated_once_before_its_first_write(monkeypatch):
    """Its pages are not in the new worker's page tables: mapped in one call
    (``format.memory.populate``) the first time the worker takes it, not again."""
    calls: list[int] = []
    monkeypatch.setattr(batches, "populate", lambda a: calls.append(a.nbytes) or True)
    c = Consumer()
    c.send(1)  # a fresh buffer: written where it was made, nothing to populate
    assert calls == []
    c.new_worker()
    assert c.pool is not None and c.pool.inherited == {0}
    c.send(2)
    assert calls == [ROW_BYTES] and not c.pool.inherited
    c.send(3)
    assert calls == [ROW_BYTES], "populated once"


@linux
@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["send", "drop", "new_worker"]), min_size=1, max_size=40))
def test_no_held_batch_changes_whatever_the_pools_adopt(ops):
    c = Consumer()
    held: list[tuple[torch.Tensor, int]] = []
    value = 0
    for op in ops:
        if op == "send":
            value = value % 250 + 1
            held.append((c.send(value), value))
        elif op == "drop" and held:
            held.pop(0)
        elif op == "new_worker":
            c.new_worker()
        for batch, v in held:
            assert torch.all(batch == v)


def _claim_in_child(block: torch.Tensor, token: str, out: Any) -> None:
    batches.table(block)[ROW, batches._OWNER] = 0  # as if the holder had not written it yet
    out.put(batches.Pool(block, token, ROW).row)


@linux
def test_a_row_whose_lock_is_held_is_not_claimed_even_when_its_owner_looks_free():
    """The owner column is written after the claim: a second process that reads it in
    between sees the row free. The lock is what keeps it out."""
    c = Consumer()
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_claim_in_child, args=(c.block, c.token, q))
    p.start()
    row = q.get()
    p.join(timeout=60)
    assert p.exitcode == 0 and row == ROW + 1
    assert c.pool is not None and c.pool.row == ROW


@linux
def test_the_consumers_lead_borrows_a_free_buffer_of_a_gone_worker_and_no_worker_adopts_it():
    """The consumer's own pool, short of buffers for its first batches, takes the free
    buffers it keeps mapped from rows whose owner is gone (never a held one, never one
    of a live worker); a worker forked later on that row finds it gone and makes a new
    one, so no two processes write one buffer."""
    c = Consumer()
    held = c.send(1)
    dropped = c.send(2)
    del dropped
    main = batches.Pool(c.block, c.token, batches.MAIN_ROW, here=True)
    assert main.borrow_idle(2) == 0, "the row's owner (this process) is alive"
    c.pool = None
    batches.table(c.block)[ROW, batches._OWNER] = 0  # the worker is gone
    assert main.borrow_idle(2) == 1, "the free buffer, not the held one"
    assert c.counters()["borrowed_buffers"] == 1 and main.inherited == {0}
    assert main.borrow_idle(2) == 0, "nothing free is left to borrow"
    slot, buf = main.take(ROW_BYTES)
    assert slot == 0 and not main.inherited and main.memory[0].nbytes == ROW_BYTES
    buf.numpy()[:] = 9  # the lead batch, written into the borrowed pages
    c.new_worker()
    assert c.counters()["adopted_buffers"] == 0, "borrowed: not adopted"
    again = c.send(3)
    assert torch.all(held == 1) and torch.all(again == 3) and bool((buf == 9).all())
    assert c.counters()["sent_buffers"] == 3, "the worker made a new buffer for the slot"


# -- through the loader ------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("fixed"), Fixed(N))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_each_epochs_new_workers_reuse_the_buffers(fixed, context):
    """Without persistent workers, four epochs: from the second on, the workers forked for
    it write into the buffers the earlier workers left, and send little storage; a batch the
    consumer holds through the epochs keeps its values. Spawned workers inherit no
    mapping: fresh buffers every epoch, as before (two epochs show it; each spawns its
    workers afresh). The reference batches come per item from forked workers: the values
    do not depend on how the workers start."""
    epochs = 4 if context == "fork" else 2

    def run(**kw: Any) -> tuple[list[Any], StreamingDataset]:
        ds = StreamingDataset(fixed, shuffle=True, seed=7)
        dl = CacheDataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork", **kw)
        return [b for _ in range(epochs) for b in dl], ds

    held_first = None
    ds = StreamingDataset(fixed, shuffle=True, seed=7)
    dl = CacheDataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=context)
    got, sent = [], []
    for _ in range(epochs):
        for b in dl:
            got.append(copy.deepcopy(b))  # (a copy: the batch itself is dropped)
            if held_first is None:
                held_first = b  # held through every epoch
        sent.append(ds.batch_stats()["sent_buffers"])
    ref, _ = run(collate_fn=per_item)
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    assert held_first is not None
    same(held_first, ref[0])
    stats = ds.batch_stats()
    if context == "fork":
        # Later epochs adopt the buffers the first one made; one may still send a new
        # one, where the consumer held a buffer (the last batch, still the loop's
        # variable) when a new worker needed one.
        assert stats["adopted_buffers"] >= 3 * sent[0] // 2, "later epochs adopt"
        assert sent[3] - sent[0] < sent[0], "later epochs send few storages (none, mostly)"
    else:
        assert stats["adopted_buffers"] == 0 and sent[1] > sent[0]


def _send(pool: batches.Pool, value: int) -> torch.Tensor:
    slot, buf = pool.take(FORM.regions(1)[1])
    buf.numpy()[:ROW_BYTES] = value
    return ForkingPickler.loads(ForkingPickler.dumps(pool.send(FORM, 1, slot, buf)))


@linux
def test_the_consumers_lead_borrows_one_buffer_of_each_gone_row_before_a_second():
    """Two gone workers left two free buffers each; the consumer's lead wants two: it
    takes one of each row, so each row's next worker still has one to adopt (taking both
    of one row made that row's next worker a fresh buffer: 256 MiB of fresh pages for
    4 MiB items)."""
    c = Consumer()
    other: batches.Pool | None = batches.Pool(c.block, c.token, ROW + 1)
    assert c.pool is not None and other is not None and other.row == ROW + 1
    for pool in (c.pool, other):
        held = [_send(pool, v) for v in (1, 2)]  # two buffers a row, both free once dropped
        del held
    c.pool = other = pool = None  # the workers end (their row locks with them)
    for row in (ROW, ROW + 1):
        batches.table(c.block)[row, batches._OWNER] = 0  # the workers are gone
    main = batches.Pool(c.block, c.token, batches.MAIN_ROW, here=True)
    assert main.borrow_idle(2) == 2
    left = sorted(row for row, _ in batches._MAPS[c.token])
    assert left == [ROW, ROW + 1], "one buffer of each row left to adopt"
    for row in (ROW, ROW + 1):
        before = c.counters()["adopted_buffers"]
        worker = batches.Pool(c.block, c.token, row)
        assert worker.row == row and c.counters()["adopted_buffers"] == before + 1
        del worker


@linux
def test_the_lead_borrows_from_the_rows_whose_workers_build_nothing_first():
    """An epoch of two batches, the first built by the consumer: worker 1 builds none. Two
    gone workers left one buffer each; the lead takes row 1's, and worker 0, which builds
    the epoch's other batch, still has its own to adopt (taking row 0's had it write that
    batch into 256 MiB of fresh pages for 4 MiB items, 0.1 s later than with none lead)."""
    c = Consumer()
    other: batches.Pool | None = batches.Pool(c.block, c.token, ROW + 1)
    assert c.pool is not None and other is not None
    for pool in (c.pool, other):
        held = _send(pool, 1)
        del held
    c.pool = other = pool = None
    for row in (ROW, ROW + 1):
        batches.table(c.block)[row, batches._OWNER] = 0  # the workers are gone
    main = batches.Pool(c.block, c.token, batches.MAIN_ROW, here=True)
    assert main.borrow_idle(1, busy_rows=ROW + 1) == 1
    assert [row for row, _ in batches._MAPS[c.token]] == [ROW], "row ROW + 1's was taken"
    before = c.counters()["adopted_buffers"]
    worker = batches.Pool(c.block, c.token, ROW)
    assert c.counters()["adopted_buffers"] == before + 1, "the busy row's worker adopts"
    del worker


@linux
@settings(max_examples=25, deadline=None)
@given(
    free=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    want=st.integers(1, batches.POOL_SLOTS),
    busy=st.integers(0, 3),
)
def test_the_lead_borrows_evenly_across_gone_rows(free, want, busy):
    """Whatever free buffers the gone rows left, however many the lead wants and however
    many of the rows' next workers build a batch soon (the busy ones, rows below
    ``busy_rows``), it takes ``min(want, their number)``: first all it needs of the rows
    that are not busy, and of a busy row one more only when every busy row with buffers
    left has given as many. The busy rows' next workers keep as many to adopt as can be."""
    c = Consumer()
    c.pool = None
    for i, k in enumerate(free):
        pool: batches.Pool | None = batches.Pool(c.block, c.token, ROW + i)
        assert pool is not None and pool.row == ROW + i
        held = [_send(pool, v) for v in range(1, k + 1)]
        del held
        pool = None
        batches.table(c.block)[ROW + i, batches._OWNER] = 0  # that worker is gone
    main = batches.Pool(c.block, c.token, batches.MAIN_ROW, here=True)
    got = main.borrow_idle(want, busy_rows=ROW + busy)
    assert got == min(want, sum(free), batches.POOL_SLOTS)
    left = [
        sum(1 for row, _ in batches._MAPS.get(c.token, {}) if row == ROW + i)
        for i in range(len(free))
    ]
    taken = [k - n for k, n in zip(free, left, strict=True)]
    spare = [i for i in range(len(free)) if i >= busy]
    if any(taken[i] for i in range(min(busy, len(free)))):
        assert all(left[i] == 0 for i in spare), "a spare row's buffer was left"
    busy_taken = [(free[i], taken[i]) for i in range(min(busy, len(free)))]
    for _, t in busy_taken:  # a busy row gave its t-th: every other gave t - 1, or all
        for k, other in busy_taken:
            assert other >= min(k, t - 1), (free, want, busy, taken)


@linux
def test_a_lead_after_an_epoch_without_one_leaves_the_busy_worker_its_buffer(fixed, monkeypatch):
    """An epoch of two batches whose first the main process builds: the other comes from
    worker 0, and worker 1 builds none. After an epoch the workers built alone (a cold one
    whose first items were too large to read by range), the lead borrows worker 1's idle
    buffer, and worker 0 writes into its own: the second epoch makes no new buffer."""
    ds = StreamingDataset(fixed)
    dl = CacheDataLoader(ds, batch_size=N // 2, num_workers=2, multiprocessing_context="fork")
    with monkeypatch.context() as m:
        m.setattr(CacheDataLoader, "_leads", lambda self, ds: False)
        assert sum(len(b["y"]) for b in dl) == N
    first = ds.batch_stats()
    assert first["pooled_buffers"] == 2 and first["borrowed_buffers"] == 0
    assert sum(len(b["y"]) for b in dl) == N
    second = ds.batch_stats()
    assert ds.lead_stats.batches == 1, "the main process built the first batch"
    assert second["borrowed_buffers"] == 1
    assert second["adopted_buffers"] - first["adopted_buffers"] == 1, "worker 0 adopted"
    assert second["pooled_buffers"] == first["pooled_buffers"], "no new buffer"
