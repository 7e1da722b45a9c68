"""When a cold epoch's chunks land, beside the raw GET of the same chunks.

Serves ``--total-mb`` of ``--item-kb`` KiB items (4 MiB by default: the shape whose cold
epoch is furthest from the cold ceiling) from a SeaweedFS server on loopback and, ``--reps``
times: the raw GET of every chunk at a cold epoch's concurrency (the limit (i), with its
client's and the store's CPU), then one cold epoch of
``CacheDataLoader(StreamingDataset(url))`` over a fresh cache dir, the clock started before
the dataset is opened. A thread lists the cache dir every 3 ms and notes when each
temporary file (a download's) and each published chunk first appears; the epoch notes
when each batch arrives.

Reported per repetition: (i)'s seconds and CPU; the epoch's seconds, its batches' arrival
times, the temporary files' and the chunks' first sightings (seconds from the clock's
start, sorted), the epoch's client and store CPU.

    python benchmarks/probes/cold_landing.py [--total-mb 512] [--item-kb 4096] [--reps 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, limits.py

import common
import limits

from asynccache import Settings


def _watch(cache: Path, t0: float, seen: dict[str, float], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            for p in cache.rglob("*chunk-*.bin*"):
                seen.setdefault(p.name, time.perf_counter() - t0)
        except FileNotFoundError:  # a temporary file renamed while listed
            pass
        time.sleep(0.003)


def _times(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in sorted(values)) + "]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.dataset_args(ap, total_mb=512, chunk_mb=64, item_kb=4096)
    ap.add_argument("--shuffle", action="store_true")
    args = ap.parse_args()
    common.quiet()
    settings = Settings.from_env(progress=False)
    with common.served_dataset(args) as (served, work):
        pid = served.store.pid
        concurrency = common.epoch_concurrency(settings, args.chunk_mb << 20, args.workers)
        cache = work / "cache"
        for rep in range(args.reps):
            raw = common.raw_get_epoch(served, concurrency)
            print(
                f"rep {rep} (i): {raw.seconds:.3f} s, CPU client {raw.cpu_client:.2f} s, "
                f"store {raw.cpu_store:.2f} s",
                flush=True,
            )
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()
            seen: dict[str, float] = {}
            stop = threading.Event()
            clock = limits.CpuClock(pid).start()
            t0 = time.perf_counter()
            watcher = threading.Thread(target=_watch, args=(cache, t0, seen, stop), daemon=True)
            watcher.start()
            loader = common.streaming_loader(
                served, cache, args.shuffle, 0, args.batch, args.workers
            )
            arrived: list[float] = []
            it = iter(loader)
            for _ in it:
                arrived.append(time.perf_counter() - t0)
            del it
            seconds = time.perf_counter() - t0
            stop.set()
            watcher.join()
            clock.stop()
            temps = [t for name, t in seen.items() if name.endswith(".tmp")]
            chunks = [t for name, t in seen.items() if name.endswith(".bin")]
            print(
                f"rep {rep} cold: {seconds:.3f} s, CPU client {clock.client:.2f} s, store "
                f"{clock.other:.2f} s; batches {_times(arrived)}; temporary files "
                f"{_times(temps)}; chunks {_times(chunks)}",
                flush=True,
            )
            del loader


if __name__ == "__main__":
    main()
