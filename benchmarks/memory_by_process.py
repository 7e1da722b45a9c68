"""Peak PSS of a cold epoch, process by process, beside the floor; pooled-slot use.

Writes ``--total-mb`` of ``--item-kb`` KiB items in 64 MiB chunks to a SeaweedFS server
on loopback, then, ``--reps`` times, runs one cold epoch of ``CacheDataLoader`` (batch
``--batch``, ``--workers`` workers) alone in a freshly spawned process, sampled from outside
every 50 ms by ``limits.PssSampler`` (the process tree's PSS: a page mapped by several
processes counts once), and once the floor (``compare.memory_epoch``: the same imports and
DataLoader moving batches of the same shape from RAM). Printed per run: the peak PSS with
its anonymous, file-backed and shared-memory parts, and each process's share at the
moment of the peak (main process and workers).

``--touch``: the consumer reads one byte of every page of each batch (as a training step
copying it to a device would), the floor's consumer too: a page the consumer reads is
mapped in its process, and counts there for as long as that mapping keeps it.

``--slots``: also one cold and one warm epoch in this process with ``batches.Pool.take``
counted (forked workers inherit the count): how often each pooled slot is taken, and how
many of the worker's slots were busy at each take.

    python benchmarks/memory_by_process.py [--total-mb 1024] [--reps 1] [--touch] [--slots]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import compare
import limits
from streaming_epoch import serve

from asynccache import CacheDataLoader, Settings, StreamingDataset
from asynccache.testing import ObjectStore

MIB = 1 << 20


def _peak_line(kind: str, seconds: float, root: int, s: limits.PssSampler) -> str:
    pk = s.peak
    line = (
        f"{kind}: {seconds:.1f} s, peak PSS {pk['Pss'] / MIB:.0f} MiB (anonymous "
        f"{pk['Pss_Anon'] / MIB:.0f}, file {pk['Pss_File'] / MIB:.0f}, shared memory "
        f"{pk['Pss_Shmem'] / MIB:.0f}); at the peak:"
    )
    for pid, d in sorted(s.at_peak_by_pid.items(), key=lambda kv: kv[0] != root):
        who = "main" if pid == root else f"worker {pid}"
        line += (
            f" {who} {d.get('Pss', 0) / MIB:.0f} (a {d.get('Pss_Anon', 0) / MIB:.0f}, "
            f"f {d.get('Pss_File', 0) / MIB:.0f}, s {d.get('Pss_Shmem', 0) / MIB:.0f})"
        )
    return line + f"; load {limits.loadavg()}"


def touched_epoch(
    floor: bool,
    url: str,
    options: dict[str, str],
    cache: str,
    batch: int,
    workers: int,
    item_bytes: int,
) -> None:
    """``compare.memory_epoch`` whose consumer reads a byte of every page of each batch."""
    compare.quiet()
    import numpy as np
    import torch
    from streaming_epoch import ListIterable
    from torch.utils.data import DataLoader

    from asynccache import CacheDataLoader, StreamingDataset

    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    loader: Any
    if floor:
        one = np.zeros(item_bytes, dtype=np.uint8)
        loader = DataLoader(
            ListIterable([one] * len(ds), batch, False, 0), batch_size=batch, num_workers=workers
        )
    else:
        loader = CacheDataLoader(ds, batch_size=batch, num_workers=workers)
    n, total = 0, 0
    for b in loader:
        n += compare.batch_len(b)
        for t in b.values() if isinstance(b, dict) else [b]:
            if isinstance(t, torch.Tensor):
                total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    if n != len(ds):
        raise SystemExit(f"memory epoch yielded {n} of {len(ds)} items ({total})")


def _count_slots(log: str) -> None:
    import asynccache.torch.batches as batches

    take = batches.Pool.take

    def counted(self: Any, nbytes: int) -> Any:
        k, buf = take(self, nbytes)
        busy = int((self.cells != 0).sum())  # (a slot is marked busy when sent)
        line = json.dumps({"pid": os.getpid(), "here": self.here, "slot": k, "busy": busy})
        with open(log, "a") as f:
            f.write(line + "\n")
        return k, buf

    batches.Pool.take = counted  # type: ignore[method-assign]


def _slots(url: str, options: dict[str, str], work: Path, args: Any) -> None:
    log = str(work / "slots.jsonl")
    _count_slots(log)
    cache = work / "slots-cache"
    for kind in ("cold", "warm"):
        open(log, "w").close()
        ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
        loader = CacheDataLoader(ds, batch_size=args.batch, num_workers=args.workers)
        n = sum(1 for _ in loader)
        by: dict[tuple[int, bool], tuple[collections.Counter[int], collections.Counter[int]]]
        by = {}
        with open(log) as f:
            for line in f:
                d = json.loads(line)
                slots, busy = by.setdefault(
                    (d["pid"], d["here"]), (collections.Counter(), collections.Counter())
                )
                slots[d["slot"]] += 1
                busy[d["busy"]] += 1
        print(f"slots, {kind} epoch of {n} batches ({ds.batch_stats()}):")
        for (pid, here), (slots, busy) in sorted(by.items(), key=lambda kv: not kv[0][1]):
            who = "main" if here else f"worker {pid}"
            print(
                f"  {who}: takes per slot {dict(sorted(slots.items()))}, slots busy at a take {dict(sorted(busy.items()))}"
            )
        ds.close()
    shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--slots", action="store_true")
    ap.add_argument("--touch", action="store_true", help="the consumer reads every page")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    ctx = mp.get_context("spawn")
    print(f"load {limits.loadavg()}", flush=True)
    try:
        with ObjectStore(volume_size_limit_mb=max(1024, args.total_mb + 256)) as store:
            on = Settings.from_env(progress=False)
            served = serve(
                store, work, args.total_mb << 20, args.item_kb << 10, 64 << 20, on.part_bytes
            )
            options = dict(store.storage_options)
            for i, floor in enumerate([False] * args.reps + [True]):
                cache = work / f"cache-{i}"
                call = (floor, served.url, options, str(cache), args.batch, args.workers)
                epoch = touched_epoch if args.touch else compare.memory_epoch
                proc = ctx.Process(target=epoch, args=(*call, args.item_kb << 10))
                t0 = time.perf_counter()
                proc.start()
                assert proc.pid is not None
                sampler = limits.PssSampler(proc.pid, interval_s=0.05)
                with sampler:
                    proc.join(600)
                if proc.exitcode != 0:
                    raise SystemExit(f"the epoch failed (exit code {proc.exitcode})")
                kind = "floor" if floor else "asynccache"
                print(_peak_line(kind, time.perf_counter() - t0, proc.pid, sampler), flush=True)
                shutil.rmtree(cache, ignore_errors=True)
            if args.slots:
                _slots(served.url, options, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
