"""Peak PSS of a cold epoch, process by process, beside the floor of the same loader.

Writes ``--total-mb`` of ``--item-kb`` KiB items in ``--chunk-mb`` MiB chunks to a
SeaweedFS server on loopback, then, ``--reps`` times each, alternating, runs in a freshly
spawned process (so that nothing of this one is counted):

* a cold epoch of ``CacheDataLoader(StreamingDataset(url))`` (batch ``--batch``,
  ``--workers`` workers) over a fresh cache dir;
* the floor: the same imports and the same ``DataLoader`` (workers, batch size, default
  collate) moving as many batches of the same shape, every item one array held in RAM:
  what any torch loader of this shape costs before it holds any data (the memory check of
  ``compare.py`` runs the same two epochs).

Each is sampled from outside every 50 ms by ``limits.PssSampler`` (the process tree's PSS:
a page mapped by several processes counts once). Printed per run: the peak PSS with its
anonymous, file-backed and shared-memory parts, and each process's share at the moment of
the peak (main process and workers); at the end the peaks beside the floor's, as a ratio
and as MiB above it.

``--touch``: the consumer reads one byte of every page of each batch (as a training step
copying it to a device would), the floor's consumer too: a page the consumer reads is
mapped in its process, and counts there for as long as that mapping keeps it.

    python benchmarks/memory_by_process.py [--total-mb 1024] [--chunk-mb 64] [--reps 1] [--touch]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import time
from typing import Any

import common
import limits

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


def epoch(
    floor: bool,
    touch: bool,
    url: str,
    options: dict[str, str],
    cache: str,
    batch: int,
    workers: int,
    item_bytes: int,
) -> None:
    """One epoch in a spawned process: asynccache's cold epoch, or the floor (``floor``)."""
    common.quiet()
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from asynccache import CacheDataLoader, StreamingDataset

    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    loader: Any
    if floor:
        one = np.zeros(item_bytes, dtype=np.uint8)
        loader = DataLoader(
            common.ListIterable([one] * len(ds), batch, False, 0),
            batch_size=batch,
            num_workers=workers,
        )
    else:
        loader = CacheDataLoader(ds, batch_size=batch, num_workers=workers)
    n, total = 0, 0
    for b in loader:
        n += len(b)
        if touch and isinstance(b, torch.Tensor):
            total += int(b.reshape(-1).view(torch.uint8)[::4096].sum())
    if n != len(ds):
        raise SystemExit(f"memory epoch yielded {n} of {len(ds)} items ({total})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=1024, chunk_mb=64, reps=1)
    ap.add_argument("--touch", action="store_true", help="the consumer reads every page")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    peaks: dict[str, list[limits.PssSampler]] = {"asynccache": [], "floor": []}
    load0 = limits.loadavg()
    with common.served_dataset(args) as (served, work):
        for i in range(args.reps):
            for floor in (False, True):
                cache = work / f"cache-{i}-{int(floor)}"
                call = (floor, args.touch, served.url, served.options_via(), str(cache))
                proc = ctx.Process(
                    target=epoch, args=(*call, args.batch, args.workers, args.item_kb << 10)
                )
                t0 = time.perf_counter()
                proc.start()
                assert proc.pid is not None
                sampler = limits.PssSampler(proc.pid, interval_s=0.05)
                with sampler:
                    proc.join(600)
                if proc.is_alive():
                    proc.kill()
                    raise SystemExit("the epoch did not end within 600 s")
                if proc.exitcode != 0:
                    raise SystemExit(f"the epoch failed (exit code {proc.exitcode})")
                kind = "floor" if floor else "asynccache"
                peaks[kind].append(sampler)
                print(_peak_line(kind, time.perf_counter() - t0, proc.pid, sampler), flush=True)
                shutil.rmtree(cache, ignore_errors=True)
    print(
        f"\ncold epoch's peak PSS, process tree (object store excluded): {served.n_items} items "
        f"x {args.item_kb} KiB in {args.chunk_mb} MiB chunks, batch {args.batch}, "
        f"{args.workers} workers{', pages touched' if args.touch else ''}; median (min-max) of "
        f"{args.reps}; {limits.cores()} cores, load {load0} -> {limits.loadavg()}"
    )
    print(limits.versions("asynccache", "torch", "numpy"))
    print("\n| run | peak PSS MiB | anonymous | file | shared memory | ÷ floor | above floor MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, samplers in peaks.items():
        pss = [s.peak["Pss"] for s in samplers]
        floors = [s.peak["Pss"] for s in peaks["floor"]]
        cells = [
            limits.cell([p / MIB for p in pss]),
            *(limits.cell([s.peak[k] / MIB for s in samplers]) for k in limits.ROLLUP_FIELDS[1:]),
            limits.cell([a / b for a, b in zip(pss, floors, strict=True)], ".2f"),
            limits.cell([(a - b) / MIB for a, b in zip(pss, floors, strict=True)]),
        ]
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
