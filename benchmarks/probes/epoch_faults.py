"""Epoch after epoch of one loader, with each process's page faults and CPU.

A loader's first epochs pay for memory it keeps later: the batch buffers of its workers
and of the main process (docs/streaming.md, "Batches"). On a machine where a fresh page
is dear (docs/performance.md, "Fresh pages on this machine"), that shows as a first warm
epoch slower than the next ones. This probe serves ``--total-mb`` of ``--item-kb`` items
from a local S3 server, times the loader over the same items in RAM (the limit (iii))
``--ceiling`` times, then, ``--reps`` times over a fresh cache dir, ``--epochs`` epochs
of one ``CacheDataLoader``: each epoch's seconds and first batch, the client's and the
object store's CPU, the main process's and the reaped workers' minor faults and system
time (``getrusage``), and the dataset's batch counters (``batch_stats()``: buffers
pooled, sent, adopted, borrowed; batches assembled or collated).

    python benchmarks/probes/epoch_faults.py [--total-mb 512] [--item-kb 4096] [--epochs 4]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, limits.py

import common
from torch.utils.data import DataLoader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.dataset_args(ap, total_mb=512, chunk_mb=64, item_kb=4096)
    ap.add_argument("--epochs", type=int, default=4, help="epochs of each loader")
    ap.add_argument("--ceiling", type=int, default=2, help="epochs of the loader over RAM")
    ap.add_argument("--shuffle", action="store_true")
    args = ap.parse_args()
    common.quiet()
    with common.served_dataset(args) as (served, work):
        pid = served.store.pid
        items = common.make_items(served.n_items, served.item_bytes)
        for _ in range(args.ceiling):
            ram = common.ListIterable(items, args.batch, args.shuffle, 0)
            dl = DataLoader(ram, batch_size=args.batch, num_workers=args.workers)
            e = common.timed_epoch(dl, pid)
            print(f"(iii) {e.seconds:.3f} s, first batch {e.first_batch_s:.3f} s", flush=True)
        del items
        cache = work / "cache"
        for rep in range(args.reps):
            shutil.rmtree(cache, ignore_errors=True)
            t = time.perf_counter()
            loader = common.streaming_loader(
                served, cache, args.shuffle, 0, args.batch, args.workers
            )
            for ep in range(args.epochs):
                me0 = resource.getrusage(resource.RUSAGE_SELF)
                kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                e = common.timed_epoch(loader, pid, start=t if ep == 0 else None)
                me1 = resource.getrusage(resource.RUSAGE_SELF)
                kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                print(
                    f"rep {rep} epoch {ep}: {e.seconds:.3f} s, first batch "
                    f"{e.first_batch_s:.3f} s, CPU client {e.cpu_client:.2f} s, store "
                    f"{e.cpu_store:.2f} s; main {me1.ru_minflt - me0.ru_minflt} faults, "
                    f"{me1.ru_stime - me0.ru_stime:.2f} s sys; workers "
                    f"{kids1.ru_minflt - kids0.ru_minflt} faults, "
                    f"{kids1.ru_stime - kids0.ru_stime:.2f} s sys",
                    flush=True,
                )
                print(f"  {loader.dataset.batch_stats()}", flush=True)
            del loader


if __name__ == "__main__":
    main()
