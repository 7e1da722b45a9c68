"""Cold prefetch from a local S3 server: asynccache's downloader vs a bare aiohttp GET loop.

Both sides fetch the same objects, as the same ranged parts, with the same number of
requests in flight, in the same run. The bare loop signs each GET and discards the body:
it is the limit of this machine (loopback + the S3 server). The downloader also writes
every byte to a fresh cache directory, verifies its xxh3_64 checksum, fsyncs and
publishes it. Reported: throughput of each, their ratio, median of ``--reps``.

    python benchmarks/download_cold.py [--total-mib 512] [--chunk-mib 8 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import tempfile
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
from asynccache.testing import ObjectStore


def _make_source(src: Path, total: int, chunk: int, blob: bytes) -> list[ChunkSpec]:
    specs = []
    for i in range(total // chunk):
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


def _bare(
    target: limits.S3Target, specs: list[ChunkSpec], concurrency: int, part_bytes: int
) -> float:
    """Signed ranged GETs, bodies discarded: the transport limit. Bytes per second."""
    parts = [(f"ds/{s.name}", a, b) for s in specs for a, b in split_parts(s.size or 0, part_bytes)]
    seconds = asyncio.run(
        limits.raw_get(target, parts, concurrency, warm=False, piece_bytes=1 << 20)
    )
    return sum(b - a for _, a, b in parts) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--chunk-mib", type=int, nargs="+", default=[64, 8, 256])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    total = args.total_mib << 20
    part_bytes = args.part_mib << 20
    lt = get_loop_thread()
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    rows = []
    try:
        with ObjectStore(volume_size_limit_mb=1024) as objstore:
            objstore.create_bucket("bench-data")
            settings = Settings(
                cache_dir=str(work / "cache"),
                max_cache_bytes=4 * total,
                max_concurrency=args.concurrency,
                part_bytes=part_bytes,
                timeout_s=60,
                progress=False,
            )
            storage = open_storage("s3://bench-data/ds", settings, objstore.storage_options)
            lt.register_closer(storage.close)
            target = limits.S3Target.of(objstore, "bench-data")
            blob = os.urandom(min(total, 256 << 20))
            for chunk_mib in args.chunk_mib:
                src = work / f"src-{chunk_mib}"
                src.mkdir()
                specs = _make_source(src, total, chunk_mib << 20, blob)
                lt.call(_upload(storage, src, specs), 1800)
                shutil.rmtree(src)
                bare: list[float] = []
                ours: dict[bool, list[float]] = {True: [], False: []}
                for rep in range(args.reps):
                    bare.append(_bare(target, specs, args.concurrency, part_bytes))
                    for durable in (True, False):
                        ours[durable].append(
                            _ours(storage, specs, settings, work, f"{chunk_mib}/{rep}", durable)
                        )
                disk = _disk_limit(work, specs, blob, settings.max_concurrency)
                b = statistics.median(bare)
                o = statistics.median(ours[True])
                f = statistics.median(ours[False])
                rows.append((chunk_mib, len(specs), b, o, f, disk))
                print(
                    f"chunk {chunk_mib:>4} MiB x {len(specs):>3}: bare {b / 1e6:8.1f} MB/s  "
                    f"asynccache {o / 1e6:8.1f} MB/s (ratio {o / b:.2f}), "
                    f"without fsync {f / 1e6:8.1f} MB/s (ratio {f / b:.2f}), "
                    f"disk write+fsync limit {disk / 1e6:8.1f} MB/s",
                    flush=True,
                )
                lt.call(_delete_all(storage, specs), 600)
    finally:
        lt.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\ncold prefetch of {args.total_mib} MiB from local SeaweedFS, "
        f"concurrency {args.concurrency}, parts {args.part_mib} MiB, median of {args.reps}"
    )
    print(
        "| chunk | chunks | bare aiohttp GET MB/s | asynccache MB/s | ratio "
        "| asynccache, no fsync MB/s | ratio | disk write+fsync MB/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for chunk_mib, n, b, o, f, disk in rows:
        print(
            f"| {chunk_mib} MiB | {n} | {b / 1e6:.0f} | {o / 1e6:.0f} | {o / b:.2f} "
            f"| {f / 1e6:.0f} | {f / b:.2f} | {disk / 1e6:.0f} |"
        )


def _disk_limit(work: Path, specs: list[ChunkSpec], blob: bytes, threads: int) -> float:
    """Writing the same bytes to new files with fsync, no network: the local disk's limit."""
    out = work / "disk"
    out.mkdir()
    view = memoryview(blob)

    def write(i: int, spec: ChunkSpec) -> None:
        size = spec.size or 0
        fd = os.open(out / spec.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            while pos < size:
                n = min(size - pos, len(view), 8 << 20)
                pos += os.pwrite(fd, view[:n], pos)
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="bench-disk") as ex:
        list(ex.map(write, range(len(specs)), specs))
    elapsed = time.perf_counter() - t0
    shutil.rmtree(out)
    return sum(s.size or 0 for s in specs) / elapsed


def _ours(storage, specs, settings, work: Path, tag: str, durable: bool) -> float:
    """One cold prefetch into an empty cache dir; bytes per second."""
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    store = ChunkStore(
        dataset_dir(cache, "s3://bench-data/ds", tag),
        max_cache_bytes=settings.max_cache_bytes,
        durable=durable,
    )
    t0 = time.perf_counter()
    stats = prefetch_dataset(storage, store, specs, settings, progress=False)
    elapsed = time.perf_counter() - t0
    assert stats.chunks_fetched == len(specs), stats
    store.close()
    shutil.rmtree(cache, ignore_errors=True)
    return stats.bytes / elapsed


async def _delete_all(storage, specs: list[ChunkSpec]) -> None:
    for s in specs:
        await storage.delete(s.name)


if __name__ == "__main__":
    main()
