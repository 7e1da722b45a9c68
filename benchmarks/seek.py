"""What a seek costs: ``CacheDataLoader.seek(S)`` near the start and a million steps in,
over a dataset of 100,000 chunks, beside what reaching step S by reading would cost.

A local dataset of ``--chunks`` tiny chunks (``--items`` items each, written by the
library's own writer, index version 2) is streamed shuffled (``shuffle_window`` 4), batch
``--batch``, ``num_workers=0``, one process. For each step S (``--steps``; default 10 and
1,000,000) it measures, median (min-max) of ``--reps``:

* seek: ``loader.seek(S)`` (the state an uninterrupted run saves after S batches, made and
  loaded: a few integers, nothing read);
* first batch: ``next(iter(loader))`` after it: the epoch's order and this rank's plan,
  the batch's chunks mapped and read;

and checks that batch against the position it must have (``state_for_step``: epoch
``S // steps``, ``(S % steps) * batch`` samples received), and for the small S against
batch S of a run read from the start. The limit beside them: reading from the start, per
batch (``--replay`` batches, timed) and extrapolated to S, which is what resuming "by
replay" (reading and dropping S batches) would take.

    .venv/bin/python benchmarks/seek.py                      # 100,000 chunks, S = 10, 10**6
    .venv/bin/python benchmarks/seek.py --chunks 2000 --steps 10 1000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

import limits

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.write.writer import ChunkWriter, merge_dir


def build(root: str, chunks: int, items: int) -> float:
    """Write ``chunks`` chunks of ``items`` items ``{"i": key}``; the seconds it took."""
    t0 = time.perf_counter()
    w = ChunkWriter(root, 0, chunk_size=items)
    for i in range(chunks * items):
        w.add(i, {"i": i})
    w.finish()
    merge_dir(root, [0])
    return time.perf_counter() - t0


def loader(root: str, batch: int) -> CacheDataLoader:
    return CacheDataLoader(StreamingDataset(root, shuffle=True, seed=1), batch_size=batch)


def keys(b: Any) -> list[int]:
    return [int(k) for k in b["i"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--items", type=int, default=10, help="items per chunk")
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 1_000_000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--replay", type=int, default=2000, help="batches read from the start")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="asynccache-seek-")
    try:
        print(f"# seek: {limits.versions('torch', 'numpy')}; {limits.machine()}")
        built = build(root, args.chunks, args.items)
        print(f"built {args.chunks:,} chunks of {args.items} items in {built:.1f} s")
        t0 = time.perf_counter()
        dl = loader(root, args.batch)
        opened = time.perf_counter() - t0
        per = dl.steps_per_epoch
        print(f"opened in {opened * 1e3:.0f} ms; {per:,} steps an epoch")
        # The limit: reading from the start, batch by batch.
        t0 = time.perf_counter()
        it = iter(dl)
        replay = [keys(next(it)) for _ in range(min(args.replay, per))]
        per_batch = (time.perf_counter() - t0) / len(replay)
        del it
        rows = []
        for step in args.steps:
            seeks, firsts = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                dl.seek(step)
                t1 = time.perf_counter()
                it = iter(dl)
                first = keys(next(it))
                t2 = time.perf_counter()
                state = dl.state_dict()
                del it
                seeks.append(t1 - t0)
                firsts.append(t2 - t1)
            epoch, b = divmod(step, per)
            assert state["epoch"] == epoch and state["batches"] == b + 1, state
            assert state["stream"]["received"] == (b + 1) * args.batch
            if step < len(replay):
                assert first == replay[step], "the batch of step S"
            rows.append((step, epoch, b, seeks, firsts, per_batch * step))
        print()
        print("| step S | epoch, batch | seek ms | first batch ms | replay to S s (limit) |")
        print("|---:|---:|---:|---:|---:|")
        for step, epoch, b, seeks, firsts, est in rows:
            print(
                f"| {step:,} | {epoch:,}, {b:,} | {limits.cell([s * 1e3 for s in seeks], ',.2f')} "
                f"| {limits.cell([f * 1e3 for f in firsts], ',.1f')} | {est:,.2f} |"
            )
        med = [statistics.median(r[3]) for r in rows]
        print(
            f"\nreading from the start: {per_batch * 1e3:.3f} ms a batch "
            f"({len(replay):,} batches); seek at the largest S / smallest S: "
            f"{med[-1] / med[0]:.2f}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
