"""The plan policy and the reader runs (pure), and the store following the policy on a
local directory: no server."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from asynccache.cache.board import Board
from asynccache.cache.plan import Deferred, EpochPlan, PlanPolicy, Stream
from asynccache.cache.store import ChunkStore
from asynccache.config import Settings
from asynccache.read.readplan import EpochSpec, PlanCache, ReaderPlace, ReadPlan
from asynccache.sampling.order import OrderSpec
from asynccache.sampling.partition import Segment
from asynccache.sampling.runs import reader_runs, reader_segments
from asynccache.write.writer import ChunkWriter, merge_dir

SIZE = 100


def stream(runs: list[tuple[int, int, int]], length: int) -> Stream:
    chunks, starts, ends = (np.array(x, dtype=np.int64) for x in zip(*runs, strict=True))
    return Stream(chunks, starts, ends, length)


def two_readers() -> EpochPlan:
    # reader 0 reads chunks 0, 1, 2 then chunk 5 again at its end (chunk 5 is read in two
    # runs); reader 1 reads 5, 3, 4. Each run is 10 positions.
    return EpochPlan(
        [
            stream([(0, 0, 10), (1, 10, 20), (2, 20, 30), (5, 30, 40)], 40),
            stream([(5, 0, 10), (3, 10, 20), (4, 20, 30)], 30),
        ],
        [SIZE] * 6,
    )


def policy(plan: EpochPlan, positions, following: EpochPlan | None = None) -> PlanPolicy:
    plans = {(0, 0): plan, (1, 0): following or plan}
    return PlanPolicy(
        [f"chunk-0-{i}.bin" for i in range(6)],
        lambda e, v: plans.get((e, v)),
        epoch=0,
        variant=0,
        readers=2,
        positions=lambda: positions,
    )


def test_minimum_is_each_readers_overlap_plus_chunks_read_in_two_runs():
    plan = two_readers()
    assert plan.shared == {5}
    assert plan.min_bytes == 2 * SIZE + SIZE  # one chunk at a time each, plus chunk 5
    overlapping = EpochPlan([stream([(0, 0, 10), (1, 2, 12), (2, 12, 20)], 20)], [SIZE] * 3)
    assert overlapping.min_bytes == 2 * SIZE


def test_victims_consumed_first_then_furthest_and_a_chunk_read_again_last():
    plan = two_readers()
    # reader 0 is at 20 (reading chunk 2), reader 1 at 10 (reading chunk 3).
    p = policy(plan, [(0, 0, 20), (0, 0, 10)])
    names = [f"chunk-0-{i}.bin" for i in (0, 1, 4, 5)]
    order = p.victims(names, {})
    # 0 and 1 are consumed (not needed this epoch), 4 is read later (distance 10), 5 was
    # read by reader 1 and is read again by reader 0: kept last.
    assert order[-2:] == ["chunk-0-4.bin", "chunk-0-5.bin"]
    assert set(order[:2]) == {"chunk-0-0.bin", "chunk-0-1.bin"}


def test_consumed_chunks_go_in_the_order_the_next_epoch_reads_them_last_first():
    plan = two_readers()
    nxt = EpochPlan([stream([(1, 0, 10), (0, 10, 20)], 20), stream([(3, 0, 10)], 10)], [SIZE] * 6)
    p = policy(plan, [(0, 0, 30), (0, 0, 25)], following=nxt)
    order = p.victims(["chunk-0-0.bin", "chunk-0-1.bin"], {})
    assert order == ["chunk-0-0.bin", "chunk-0-1.bin"]  # chunk 1 is read first next epoch


def test_a_reader_finishing_the_last_epoch_keeps_what_it_reads_in_this_one():
    plan = two_readers()
    # This process is in epoch 1; reader 1 has not left epoch 0's end yet: chunk 3, which
    # it reads early in epoch 1, is "this epoch", behind a chunk nobody needs until epoch 2.
    plans = {(0, 0): plan, (1, 0): plan, (2, 0): plan}
    p = PlanPolicy(
        [f"chunk-0-{i}.bin" for i in range(6)],
        lambda e, v: plans.get((e, v)),
        epoch=1,
        variant=0,
        readers=2,
        positions=lambda: [(1, 0, 30), (0, 0, 30)],
    )
    assert p.victims(["chunk-0-3.bin", "chunk-0-0.bin"], {}) == ["chunk-0-0.bin", "chunk-0-3.bin"]


def test_prefetch_room_is_the_budget_less_the_minimum():
    plan = two_readers()
    p = policy(plan, [(0, 0, 0), (0, 0, 0)])
    budget = plan.min_bytes + SIZE  # room for one chunk ahead
    assert p.admits("chunk-0-1.bin", SIZE, ["chunk-0-0.bin", "chunk-0-5.bin"], budget)
    assert not p.admits("chunk-0-2.bin", SIZE, ["chunk-0-0.bin", "chunk-0-1.bin"], budget)
    # What a reader reads now, and a chunk read in two runs, are always admitted.
    assert p.admits("chunk-0-5.bin", SIZE, ["chunk-0-1.bin", "chunk-0-2.bin"], plan.min_bytes)
    assert not p.fits_whole(budget)
    assert p.fits_whole(plan.min_bytes + 6 * SIZE)


def test_runs_split_at_gaps_and_order_by_start():
    # keys 0..9 in chunk 0, 10..19 in chunk 1; the reader reads 0..4, 10..14, then 0..2.
    segs = [Segment(0, 5), Segment(10, 15), Segment(0, 3, pad=True)]
    runs = reader_runs(segs, lambda a, b: np.arange(a, b), lambda k: k // 10, gap=1)
    assert runs.chunks.tolist() == [0, 1, 0]
    assert runs.starts.tolist() == [0, 5, 10]
    assert runs.ends.tolist() == [5, 10, 13]
    assert runs.length == 13


def test_reader_segments_cover_the_epoch_once_per_rank_and_worker():
    segs = reader_segments([(0, 100)], world=2, num_workers=2, batch_size=8, drop_last=True)
    assert len(segs) == 4
    covered = sorted(p for s in segs for seg in s for p in range(seg.start, seg.end))
    assert covered == list(range(100))


def test_board_slots_round_trip_and_unknown_reads_as_none(tmp_path):
    board = Board(str(tmp_path / "plan-x.board"), 3)
    assert board.read() == [None, None, None]
    board.write(1, 4, 0, 123)
    board.write(2, 4, 7, 5)
    assert board.read() == [None, (4, 0, 123), (4, 7, 5)]
    board.close()


def test_a_prefetch_may_push_out_only_what_no_reader_needs_again_this_epoch():
    plan = two_readers()
    # reader 0 is at 20 (reading chunk 2), reader 1 at 10 (reading chunk 3): 0 and 1 are
    # consumed; 2 and 3 are read now; 4 is read later; 5 is read again by reader 0. Chunk
    # 0 is what reader 0 starts the next epoch with (the same plan): kept from prefetches.
    p = policy(plan, [(0, 0, 20), (0, 0, 10)])
    names = [f"chunk-0-{i}.bin" for i in range(6)] + ["other.bin"]
    assert p.spare(names) == ["chunk-0-1.bin", "other.bin"]


def test_a_prefetch_that_would_push_out_a_chunk_still_to_be_read_is_deferred(tmp_path):
    # The store's side: a cache holding only chunks still to be read this epoch defers a
    # prefetch (nothing is removed); a demand fetch of the same size evicts as before.
    settings = Settings.from_env(cache_dir=str(tmp_path), max_cache_bytes=3 * SIZE)
    store = ChunkStore.for_dataset(settings, "s3://bucket/ds", "id", durable=False)
    for i in (4, 5, 2):  # 4: read later; 5: read again; 2: read now
        tmp = store.create_temp(f"chunk-0-{i}.bin", SIZE)
        os.pwrite(tmp.fd, b"x" * SIZE, 0)
        tmp.publish()
    store.policy = policy(two_readers(), [(0, 0, 20), (0, 0, 10)])
    with pytest.raises(Deferred):
        asyncio.run(store.reserve("chunk-0-3.bin", SIZE, ahead=True))
    assert {"chunk-0-2.bin", "chunk-0-4.bin", "chunk-0-5.bin"} <= set(os.listdir(store.root))
    tmp = asyncio.run(store.reserve("chunk-0-3.bin", SIZE))  # a reader waits: evict
    tmp.discard()
    assert "chunk-0-4.bin" not in os.listdir(store.root), "the furthest one went"


def small_plan(tmp_path, batch_size: int, skipped: int = 0) -> ReadPlan:
    """One reader of 40 items in 10 chunks of 4, in order: chunk c is read over [4c, 4c+4),
    runs widened to the batches they touch."""
    src = str(tmp_path / "src")
    w = ChunkWriter(src, 0, chunk_bytes=4 * 200)
    for i in range(40):
        w.add(i, {"i": i, "x": np.zeros(100, np.uint8)})
    w.finish()
    index = merge_dir(src, [0])
    assert index.num_chunks == 10
    spec = EpochSpec(
        ReaderPlace(
            epoch=0,
            remaining=((0, 40),),
            received=0,
            world=1,
            rank=0,
            num_workers=1,
            worker=0,
            batch_size=batch_size,
            drop_last=False,
        ),
        OrderSpec(0, False, 1),
    )
    root = tmp_path / "cache"
    os.makedirs(root / ".locks")
    return ReadPlan(index, spec, PlanCache(index, spec), str(root), skipped)


def test_a_reader_of_whole_batches_holds_every_chunk_of_a_batch(tmp_path):
    # Batches of 8 positions: chunks 0 and 1 are both read over [0, 8), so asking for
    # chunk 1 first does not make chunk 0 look consumed, and the minimum counts both.
    rp = small_plan(tmp_path, batch_size=8)
    assert rp.upcoming(3) == [0, 1, 2]
    assert not rp.start(1) and not rp.start(0)  # both read now, from position 0
    assert rp.reads_now(0) and rp.reads_now(1) and not rp.reads_now(2)
    assert rp.policy.min_bytes == 2 * max(rp.index.bytes_per_chunk.tolist())
    assert rp.start(3)  # the next batch
    assert rp.pos == 8 and rp.board.read()[0] == (0, 0, 8)
    rp.close()


def test_a_batch_asking_for_its_chunks_out_of_order_keeps_the_run_it_passed(tmp_path):
    # Resumed at position 4, the reader's batches are [4, 12), [12, 20)...: not those the
    # plan widened its runs to. The batch [4, 12) asks for chunk 2 before chunk 1 (its
    # chunks in number order, say). Chunk 1's run is passed but not read yet: it must stay
    # hinted and on the board, or its prefetch is cancelled and it is evicted as consumed,
    # then fetched again (seen with two ranks: a chunk GET twice in a cold epoch).
    rp = small_plan(tmp_path, batch_size=8, skipped=4)
    assert rp.start(2)
    assert rp.pos == 8
    assert rp.board.read()[0] == (0, 0, 0), "held at the passed runs' start"
    # the chunk just started first (asked for right after the hint), then the passed ones
    assert rp.upcoming(4) == [2, 0, 1, 3]
    assert rp.reads_now(1)
    assert not rp.start(1)  # the passed run, started now
    assert rp.board.read()[0] == (0, 0, 0), "chunk 0's run: still pending"
    # A run passed and never started (chunk 0: skipped; or items read by range) holds the
    # board only until the position is a batch past its end.
    assert rp.start(4)  # position 16: chunk 0's run [0, 8) expires, chunk 3's is passed
    assert rp.board.read()[0] == (0, 0, 8)
    assert not rp.reads_now(0) and rp.reads_now(3)
    assert not rp.start(3)
    assert rp.board.read()[0] == (0, 0, 16)
    rp.close()


def test_a_stale_slot_of_the_last_epoch_reads_as_the_start_of_this_one():
    # Reader 1's new workers have not started epoch 1: its slot still says where it was
    # at the end of epoch 0. Read as it was, the last chunks of its epoch 0 would be held
    # as "being read" and this epoch's chunks ranked from the wrong place.
    plan = two_readers()
    plans = {(0, 0): plan, (1, 0): plan, (2, 0): plan}
    slots = [(1, 0, 20), (0, 0, 25)]
    p = PlanPolicy(
        [f"chunk-0-{i}.bin" for i in range(6)],
        lambda e, v: plans.get((e, v)),
        epoch=1,
        variant=0,
        readers=2,
        positions=lambda: slots,
    )
    # chunk 4: reader 1 reads it at 25 of epoch 0 (run [20, 30)), where it may still be
    # (finishing that epoch, the chunk just downloaded and not pinned yet): held, with
    # chunk 5, which it reads first in epoch 1 (the rest ranked from that start).
    order = p.victims([f"chunk-0-{i}.bin" for i in (0, 3, 4, 5)], {})
    assert order == ["chunk-0-0.bin", "chunk-0-3.bin", "chunk-0-4.bin", "chunk-0-5.bin"]
    assert p.spare(["chunk-0-4.bin"]) == []  # still to be read this epoch
    slots[1] = (0, 0, 30)  # at its epoch-0 end: nothing of that epoch kept
    order = p.victims([f"chunk-0-{i}.bin" for i in (0, 3, 4, 5)], {})
    assert order == ["chunk-0-0.bin", "chunk-0-4.bin", "chunk-0-3.bin", "chunk-0-5.bin"]
    slots[1] = (0, 0, 25)
    # The same slot, were this process still in epoch 0, is read as it is.
    slots[0] = (0, 0, 20)
    q = PlanPolicy(
        [f"chunk-0-{i}.bin" for i in range(6)],
        lambda e, v: plans.get((e, v)),
        epoch=0,
        variant=0,
        readers=2,
        positions=lambda: slots,
    )
    assert q.spare(["chunk-0-4.bin"]) == []  # reader 1 reads it now
    # A slot from more than one epoch ahead (an earlier run of the same plan) is unknown:
    # the reader is taken to be at the start (chunk 1 read at 10, chunk 4 at 20), not at 25
    # of epoch 7 (chunk 1 read already, chunk 4 being read).
    slots[:] = [(7, 0, 20), (7, 0, 25)]
    r = PlanPolicy(
        [f"chunk-0-{i}.bin" for i in range(6)],
        lambda e, v: plan,
        epoch=0,
        variant=0,
        readers=2,
        positions=lambda: slots,
    )
    assert r.victims(["chunk-0-1.bin", "chunk-0-4.bin"], {}) == ["chunk-0-4.bin", "chunk-0-1.bin"]
