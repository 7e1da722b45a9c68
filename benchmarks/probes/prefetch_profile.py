"""One cold ``prefetch_dataset`` from a local S3 server, to profile the I/O thread.

Uploads ``--total-mib`` in ``--chunk-mib`` chunks (on the main thread, its own loop), then
prefetches them cold into a fresh cache (on the process's I/O thread) with the receive
path ``--receive`` and prints wall time and this process's CPU. Run it under py-spy to see
where the I/O thread's CPU goes, e.g.::

    py-spy record --native --threads -r 200 -f raw -o prof.txt -- \\
        python benchmarks/probes/prefetch_profile.py --receive direct
    python benchmarks/probes/prefetch_profile.py --summarize prof.txt

``--summarize`` prints the I/O thread's samples by leaf (the function on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import resource
import shutil
import sys
import threading
import time
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # limits.py

import limits

from asynccache.bridge import get_loop_thread
from asynccache.cache import ChunkStore, dataset_dir
from asynccache.config import Settings
from asynccache.download import ChunkSpec, prefetch_dataset
from asynccache.storage import open_storage

_LEAVES = (
    ("pwrite", "pwrite into the page cache"),
    ("recv", "recv (kernel to user copy)"),
    ("__libc_recv", "recv (kernel to user copy)"),
    ("sendto", "sending requests"),
    ("sendmsg", "sending requests"),
    ("send", "sending requests"),
    ("epoll_wait", "waiting in epoll"),
    ("sync_file_range", "writeback requests"),
    ("XXH3", "hash"),
)


# Hand-offs to other threads, counted wherever they are in the stack (not only as leaves).
_HANDOFFS = (
    ("ThreadPoolExecutor.submit", "ThreadPoolExecutor.submit (to_thread, executor hand-offs)"),
    ("request_writeback", "writeback requests (queue, wake-up, descriptor duplicate)"),
    ("call_soon_threadsafe", "call_soon_threadsafe"),
)


def summarize(path: str) -> None:
    """Share of the I/O thread's samples by what was on CPU."""
    counts: collections.Counter[str] = collections.Counter()
    handoffs: collections.Counter[str] = collections.Counter()
    total = every = 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "prefetch_dataset" in stack or "asynccache-io" in stack:
            every += int(n)  # the prefetch's own samples (not the upload's)
        if "asynccache-io" not in stack:
            continue
        frames = stack.split(";")
        total += int(n)
        for key, label in _HANDOFFS:
            if any(key in f for f in frames):
                handoffs[label] += int(n)
        leaf = frames[-1]
        name = next((label for key, label in _LEAVES if key in leaf), None)
        if name is None:
            py = [f for f in frames if ".py:" in f or ".py)" in f]
            name = py[-1].split(" ")[0] + " " + py[-1].split("/")[-1] if py else leaf
        counts[name] += int(n)
    print(f"I/O thread samples: {total} ({100 * total / max(every, 1):.0f}% of the prefetch's)")
    for name, n in handoffs.most_common():
        print(f"{100 * n / max(total, 1):5.1f}%  (within) {name}")
    for name, n in counts.most_common(25):
        print(f"{100 * n / max(total, 1):5.1f}%  {name}")


def _thread_cpu(name: str) -> float:
    """CPU seconds (user + system) of this process's thread called ``name`` so far."""
    tick = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
            rest = fields.rsplit(")", 1)[1].split()
            return (int(rest[11]) + int(rest[12])) / tick
    return 0.0


async def _upload(storage, src: Path, names: list[str]) -> None:
    sem = asyncio.Semaphore(4)

    async def one(name: str) -> None:
        async with sem:
            await storage.upload(src / name, name)

    await asyncio.gather(*(one(n) for n in names))
    await storage.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--receive", default="direct", choices=["direct", "aiohttp"])
    ap.add_argument("--durable", type=int, default=1)
    ap.add_argument("--summarize", metavar="PYSPY_RAW")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    chunk = args.chunk_mib << 20
    with limits.object_store(args.total_mib) as (objstore, work):
        objstore.create_bucket("prof")
        src = work / "src"
        src.mkdir()
        blob = os.urandom(chunk)
        specs = []
        for i in range(max(1, (args.total_mib << 20) // chunk)):
            data = blob[i:] + blob[:i]
            (src / f"c-{i}.bin").write_bytes(data)
            specs.append(ChunkSpec(f"c-{i}.bin", chunk, xxhash.xxh3_64(data).hexdigest()))
        settings = Settings(
            cache_dir=str(work / "cache"),
            max_concurrency=args.concurrency,
            part_bytes=args.part_mib << 20,
            adaptive_parts=False,
            progress=False,
            receive=args.receive,
            durable=bool(args.durable),
        )
        up = open_storage("s3://prof/ds", settings, objstore.storage_options)
        asyncio.run(_upload(up, src, [s.name for s in specs]))
        shutil.rmtree(src)
        storage = open_storage("s3://prof/ds", settings, objstore.storage_options)
        lt = get_loop_thread()
        lt.register_closer(storage.close)
        store = ChunkStore(
            dataset_dir(work / "cache", "s3://prof/ds", "p"),
            max_cache_bytes=4 << 30,
            durable=bool(args.durable),
        )
        lt.call(asyncio.sleep(0), 10)  # the I/O thread runs
        io0 = _thread_cpu("asynccache-io")
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        prefetch_dataset(storage, store, specs, settings, progress=False)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        io_cpu = _thread_cpu("asynccache-io") - io0
        cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        print(
            f"receive={args.receive} durable={args.durable}: {args.total_mib} MiB in "
            f"{wall:.2f} s, client CPU {cpu:.2f} s ({cpu / (args.total_mib / 1024):.2f} "
            f"s/GiB; the I/O thread {io_cpu:.2f} s), load {limits.loadavg()}"
        )
        store.close()
        lt.close()


if __name__ == "__main__":
    main()
