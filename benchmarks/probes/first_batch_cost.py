"""What building the first batches in the main process costs a whole epoch.

Writes ``--total-mb`` of ``--item-kb`` KiB items in ``--chunk-mb`` MiB chunks to a SeaweedFS
server on loopback and times, ``--reps`` times each, whole epochs of
``CacheDataLoader(StreamingDataset(url), batch_size, num_workers)`` (a new loader each
time, no work between batches) with the first batches built in the main process (the
default) and made by the workers (``Settings(first_batch_here=False)``), the two runs of
a case back to back, their order alternating between repetitions: cold (a fresh cache
dir) and warm (a cache that holds every chunk), unshuffled and shuffled. The dataset is
opened before the clock starts.

Reported per case: the epoch's seconds, the first batch's and the second's (asked for
right after the first), median (min-max), and the epoch time with the first batch built
here ÷ the epoch time without, taken within each repetition (the cost: 1.0 is none).

    python benchmarks/probes/first_batch_cost.py [--total-mb 256] [--reps 5] [--cases warm,cold]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, limits.py

import common
import limits

from asynccache import CacheDataLoader, Settings, StreamingDataset, prefetch


@dataclass
class Runs:
    epoch: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    second: list[float] = field(default_factory=list)


def once(url: str, options: dict[str, str], cache: Path, shuffle: bool, here: bool, args: Any):
    settings = Settings.from_env(progress=False, first_batch_here=here)
    ds = StreamingDataset(
        url, cache_dir=cache, shuffle=shuffle, seed=1, storage_options=options, settings=settings
    )
    loader = CacheDataLoader(ds, batch_size=args.batch, num_workers=args.workers)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    next(it)
    second = time.perf_counter() - t0
    n = 2
    for _ in it:
        n += 1
    del it
    epoch = time.perf_counter() - t0
    ds.close()
    return epoch, first, second, n


def _fmt(xs: list[float], unit: str = "s") -> str:
    return f"{statistics.median(xs):.3f}{unit} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=256, chunk_mb=64, reps=5)
    ap.add_argument("--cases", default="warm,cold", help="warm, cold or both")
    ap.add_argument("--shuffle", default="off,on", help="off, on or both")
    args = ap.parse_args()
    load0 = limits.loadavg()
    runs: dict[tuple[str, bool, bool], Runs] = {}
    with common.served_dataset(args) as (served, work):
        on = Settings.from_env(progress=False)
        options = dict(served.store.storage_options)
        warm = work / "warm"
        prefetch(served.url, warm, options, settings=on)
        for rep in range(args.reps):
            for case in args.cases.split(","):
                for shuffle in (s == "on" for s in args.shuffle.split(",")):
                    for here in (True, False) if rep % 2 == 0 else (False, True):
                        cache = warm if case == "warm" else work / f"cold-{rep}-{here}"
                        epoch, first, second, _n = once(
                            served.url, options, cache, shuffle, here, args
                        )
                        r = runs.setdefault((case, shuffle, here), Runs())
                        r.epoch.append(epoch)
                        r.first.append(first)
                        r.second.append(second)
                        if cache is not warm:
                            shutil.rmtree(cache, ignore_errors=True)
            print(f"rep {rep} done, load {limits.loadavg()}", flush=True)
    print(
        f"\n{args.total_mb} MiB of {args.item_kb} KiB items in {args.chunk_mb} MiB chunks, "
        f"batch {args.batch}, {args.workers} workers, {args.reps} reps; load before "
        f"{load0}, after {limits.loadavg()}\n"
    )
    print(
        "| case | here: epoch | first | second | workers only: epoch | first | second "
        "| epoch here ÷ workers only |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for case in args.cases.split(","):
        for shuffle in (s == "on" for s in args.shuffle.split(",")):
            a, b = runs[(case, shuffle, True)], runs[(case, shuffle, False)]
            ratio = [x / y for x, y in zip(a.epoch, b.epoch, strict=True)]
            name = f"{case}, {'shuffled' if shuffle else 'unshuffled'}"
            print(
                f"| {name} | {_fmt(a.epoch)} | {_fmt(a.first)} | {_fmt(a.second)} "
                f"| {_fmt(b.epoch)} | {_fmt(b.first)} | {_fmt(b.second)} | {_fmt(ratio, '')} |"
            )


if __name__ == "__main__":
    main()
