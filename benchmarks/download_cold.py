"""Cold prefetch from a local S3 server: asynccache's downloader vs the bare GET loops.

All sides fetch the same objects, as the same ranged parts, with the same number of
requests in flight, in the same run:

* (i) raw GET: the bare aiohttp loop, bodies counted and dropped;
* (i-b) raw GET into files: the same loop writing each object into a file with ``pwrite``
  as pieces arrive (no checksum, no fsync): the limit of a cache on this box;
* asynccache: ``prefetch_dataset`` into a fresh cache dir (write, xxh3_64 verification,
  atomic publish), durable (the default: each chunk stamped with the boot, no fsync;
  with ``ASYNCCACHE_FSYNC_PUBLISH=1`` each fsynced) and not (``ASYNCCACHE_DURABLE=0``), for
  each receive path in ``--receive`` (``ASYNCCACHE_RECEIVE``: ``direct``, our own HTTP/1.1
  receiver, or ``aiohttp``), each in the same repetition.

Reported per chunk size: wall-time ratios to (i-b) and (i), and client CPU seconds (this
process, ``getrusage``) as a ratio to (i-b)'s, median (min-max) of ``--reps``, each ratio
computed within one repetition. The object store's CPU is shown for reference. A durable
cache that fsyncs must also get every byte onto the disk, which (i-b) never does: the same bytes
written to new files and fsynced (no network, same threads) is measured too, and the
durable figure is also given against the slower of (i-b) and that disk limit.

    python benchmarks/download_cold.py [--total-mib 512] [--chunk-mib 64 8 256]
        [--concurrency 8] [--part-mib <ASYNCCACHE_PART_BYTES default>] [--reps 3]
        [--receive direct aiohttp]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path

import limits
import xxhash

from asynccache.bridge import get_loop_thread
from asynccache.cache import ChunkStore, dataset_dir
from asynccache.config import Settings
from asynccache.download import ChunkSpec, prefetch_dataset
from asynccache.download.parts import split_parts
from asynccache.storage import open_storage


def _make_source(src: Path, total: int, chunk: int, blob: bytes) -> list[ChunkSpec]:
    specs = []
    for i in range(max(1, total // chunk)):
        data = blob[(i * chunk) % len(blob) :][:chunk]
        if len(data) < chunk:
            data += blob[: chunk - len(data)]
        name = f"c{chunk >> 20}m-{i}.bin"
        (src / name).write_bytes(data)
        specs.append(ChunkSpec(name, chunk, xxhash.xxh3_64(data).hexdigest()))
    return specs


async def _upload(storage, src: Path, specs: list[ChunkSpec]) -> None:
    sem = asyncio.Semaphore(4)

    async def one(spec: ChunkSpec) -> None:
        async with sem:
            await storage.upload(src / spec.name, spec.name)

    await asyncio.gather(*(one(s) for s in specs))


def _parts(specs: list[ChunkSpec], part_bytes: int) -> list[limits.Part]:
    return [(f"ds/{s.name}", a, b) for s in specs for a, b in split_parts(s.size or 0, part_bytes)]


class Run:
    """One measured side of one repetition: seconds, client CPU s, store CPU s."""

    def __init__(self, seconds: float, clock: limits.CpuClock) -> None:
        self.seconds, self.cpu, self.store_cpu = seconds, clock.client, clock.other


def _bare(target, specs, concurrency, part_bytes, store_pid) -> Run:
    with limits.CpuClock(store_pid) as clock:
        seconds = asyncio.run(limits.raw_get(target, _parts(specs, part_bytes), concurrency))
    return Run(seconds, clock)


def _into_files(target, specs, concurrency, part_bytes, store_pid, work: Path) -> Run:
    out = work / "raw-files"
    shutil.rmtree(out, ignore_errors=True)
    with limits.CpuClock(store_pid) as clock:
        seconds = asyncio.run(
            limits.raw_get_into_files(target, _parts(specs, part_bytes), concurrency, out)
        )
    shutil.rmtree(out, ignore_errors=True)
    return Run(seconds, clock)


def _ours(storage, settings, specs, work: Path, tag: str, durable: bool, store_pid) -> Run:
    """One cold prefetch into an empty cache dir."""
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    store = ChunkStore(
        dataset_dir(cache, "s3://bench-data/ds", tag),
        max_cache_bytes=settings.max_cache_bytes,
        durable=durable,
        stamps=not settings.fsync_publish,
    )
    with limits.CpuClock(store_pid) as clock:
        t0 = time.perf_counter()
        stats = prefetch_dataset(storage, store, specs, settings, progress=False)
        seconds = time.perf_counter() - t0
    assert stats.chunks_fetched == len(specs), stats
    store.close()
    shutil.rmtree(cache, ignore_errors=True)
    return Run(seconds, clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--chunk-mib", type=int, nargs="+", default=[64, 8, 256])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=Settings().part_bytes >> 20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--receive", nargs="+", default=["direct"], choices=["direct", "aiohttp"])
    args = ap.parse_args()
    total = args.total_mib << 20
    part_bytes = args.part_mib << 20
    lt = get_loop_thread()
    load_before = limits.loadavg()
    rows = []
    try:
        with limits.object_store(args.total_mib) as (objstore, work):
            objstore.create_bucket("bench-data")
            settings = Settings(
                cache_dir=str(work / "cache"),
                max_cache_bytes=4 * total,
                max_concurrency=args.concurrency,
                part_bytes=part_bytes,
                adaptive_parts=False,  # the same parts as the bare loop's (like for like)
                timeout_s=60,
                progress=False,
            )
            storage = open_storage("s3://bench-data/ds", settings, objstore.storage_options)
            lt.register_closer(storage.close)
            paths = {}
            for mode in args.receive:
                paths[mode] = (
                    dataclasses.replace(settings, receive=mode),
                    open_storage(
                        "s3://bench-data/ds",
                        dataclasses.replace(settings, receive=mode),
                        objstore.storage_options,
                    ),
                )
                lt.register_closer(paths[mode][1].close)
            target = limits.S3Target.of(objstore, "bench-data")
            blob = os.urandom(min(total, 256 << 20))
            pid = objstore.pid
            for chunk_mib in args.chunk_mib:
                src = work / f"src-{chunk_mib}"
                src.mkdir()
                specs = _make_source(src, total, chunk_mib << 20, blob)
                lt.call(_upload(storage, src, specs), 1800)
                shutil.rmtree(src)
                reps: list[dict[str, Run]] = []
                for rep in range(args.reps):
                    runs = {
                        "bare": _bare(target, specs, args.concurrency, part_bytes, pid),
                        "files": _into_files(
                            target, specs, args.concurrency, part_bytes, pid, work
                        ),
                    }
                    for mode, (mode_settings, mode_storage) in paths.items():
                        for durable in (True, False):
                            runs[f"{'ours' if durable else 'nosync'}:{mode}"] = _ours(
                                mode_storage,
                                mode_settings,
                                specs,
                                work,
                                f"{chunk_mib}/{rep}/{mode}",
                                durable,
                                pid,
                            )
                    runs["disk"] = _disk(
                        work, sum(sp.size or 0 for sp in specs), chunk_mib << 20, args.concurrency
                    )
                    reps.append(runs)
                rows.append((chunk_mib, len(specs), reps))
                for mode in paths:
                    print(_line(chunk_mib, len(specs), reps, total, mode), flush=True)
                lt.call(_delete_all(storage, specs), 600)
    finally:
        lt.close()
    print(
        f"\ncold prefetch of {args.total_mib} MiB from local SeaweedFS, concurrency "
        f"{args.concurrency}, parts {args.part_mib} MiB, median (min-max) of {args.reps}; "
        f"{limits.cores()} cores, load {load_before} -> {limits.loadavg()}; "
        f"{limits.versions('aiohttp', 'xxhash')}"
    )
    print(
        "| chunk | chunks | receive | (i-b) raw GET into files MB/s | asynccache wall / (i-b) "
        "| CPU / (i-b) CPU | no fsync: wall / (i-b) | CPU / (i-b) CPU | (i-b) / (i) "
        "| CPU s (i-b) | store CPU s (i-b) | disk write+fsync / (i-b) "
        "| asynccache wall / min((i-b), disk) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for chunk_mib, n, reps in rows:
        for mode in args.receive:
            cells = " | ".join(_cells(reps, total, mode))
            print(f"| {chunk_mib} MiB | {n} | {mode} | {cells} |")


def _ratios(reps: list[dict[str, Run]], total: int, mode: str) -> dict[str, list[float]]:
    keys = ("mbs", "o", "oc", "n", "nc", "fb", "fc", "sc", "d", "od")
    out: dict[str, list[float]] = {k: [] for k in keys}
    for runs in reps:
        r = {**runs, "ours": runs[f"ours:{mode}"], "nosync": runs[f"nosync:{mode}"]}
        f = r["files"]
        out["mbs"].append(total / f.seconds / 1e6)
        out["o"].append(f.seconds / r["ours"].seconds)
        out["oc"].append(r["ours"].cpu / f.cpu)
        out["n"].append(f.seconds / r["nosync"].seconds)
        out["nc"].append(r["nosync"].cpu / f.cpu)
        out["fb"].append(r["bare"].seconds / f.seconds)
        out["fc"].append(f.cpu)
        out["sc"].append(f.store_cpu)
        out["d"].append(f.seconds / r["disk"].seconds)
        out["od"].append(max(f.seconds, r["disk"].seconds) / r["ours"].seconds)
    return out


def _cells(reps: list[dict[str, Run]], total: int, mode: str) -> list[str]:
    r = _ratios(reps, total, mode)
    return [
        limits.cell(r["mbs"], ",.0f"),
        limits.cell(r["o"], ".2f"),
        limits.cell(r["oc"], ".2f"),
        limits.cell(r["n"], ".2f"),
        limits.cell(r["nc"], ".2f"),
        limits.cell(r["fb"], ".2f"),
        limits.cell(r["fc"], ".2f"),
        limits.cell(r["sc"], ".2f"),
        limits.cell(r["d"], ".2f"),
        limits.cell(r["od"], ".2f"),
    ]


def _line(chunk_mib: int, n: int, reps: list[dict[str, Run]], total: int, mode: str) -> str:
    r = _ratios(reps, total, mode)
    med = statistics.median
    return (
        f"chunk {chunk_mib:>4} MiB x {n:>3}: (i-b) {med(r['mbs']):7.0f} MB/s; asynccache "
        f"({mode}) "
        f"wall {med(r['o']):.2f} CPU {med(r['oc']):.2f} of (i-b); no fsync wall "
        f"{med(r['n']):.2f} CPU {med(r['nc']):.2f}; (i-b)/(i) {med(r['fb']):.2f}"
    )


def _disk(work: Path, total: int, chunk_bytes: int, threads: int) -> Run:
    """The same bytes written to new files and fsynced, no network: the disk's limit."""
    with limits.CpuClock() as clock:
        seconds = limits.durable_write(work / "disk", total, chunk_bytes, threads)
    return Run(seconds, clock)


async def _delete_all(storage, specs: list[ChunkSpec]) -> None:
    for s in specs:
        await storage.delete(s.name)


if __name__ == "__main__":
    main()
