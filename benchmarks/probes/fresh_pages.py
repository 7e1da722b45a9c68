"""What memory the machine has not handed out lately costs on first touch.

On a virtual machine that gives freed memory back to its host, a page touched for the
first time since it was freed waits for the host to back it again. Three measurements, each
in a fresh process:

* ``fill``: filling a fresh ``--mib`` array from a file: ``np.empty`` (numpy advises huge
  pages from 4 MiB on) against :func:`asynccache.format.memory.fresh_bytes` (base pages),
  three times each;
* ``write``: writing ``--mib`` MiB into a new file (the page cache), right after ``--churn``
  MiB of anonymous memory was touched and freed (and ``--sleep`` s waited), against
  without;
* ``refill``: writing ``--mib`` MiB into a new file, removing it, waiting each of
  ``--waits`` seconds, and timing the same write again (which takes the pages just freed,
  unless the kernel has reported them to the host meanwhile: free page reporting,
  ``limits.free_page_reporting``);
* ``cold``: one cold epoch of ``--mib`` MiB of 100 KiB arrays from the local S3 server,
  2 workers, after the same churn and without (what a loader that caches chunks on disk
  pays: every downloaded byte lands in fresh page-cache pages).

    python benchmarks/probes/fresh_pages.py [--mib 512] [--churn 1024] [--sleep 1] [--rounds 2]
        [--waits 0,5,0.5,3] [--refill-only]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shapes.py

MIB = 1 << 20


def churn(mib: int, sleep_s: float) -> None:
    """Touch ``mib`` MiB of anonymous memory, free it, wait."""
    if mib:
        junk = [np.ones(MIB, np.uint8) for _ in range(mib)]
        del junk
    time.sleep(sleep_s)


def cpu_s() -> float:
    r, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def fill(way: str, mib: int, src: str, out: mp.Queue) -> None:
    from asynccache.format.memory import fresh_bytes

    fd = os.open(src, os.O_RDONLY)
    size = os.path.getsize(src)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        a = np.empty(mib * MIB, np.uint8) if way == "np.empty" else fresh_bytes(mib * MIB)
        got = 0
        while got < a.size:
            got += os.preadv(fd, [a[got : got + 4 * MIB]], got % (size - 4 * MIB))
        times.append(time.perf_counter() - t)
        del a
    out.put(times)


def write(mib: int, churn_mib: int, sleep_s: float, where: str, out: mp.Queue) -> None:
    churn(churn_mib, sleep_s)
    block = np.random.default_rng(0).bytes(MIB)
    c, t = cpu_s(), time.perf_counter()
    with open(os.path.join(where, "fresh.bin"), "wb") as f:
        for _ in range(mib):
            f.write(block)
    out.put((time.perf_counter() - t, cpu_s() - c))
    os.unlink(os.path.join(where, "fresh.bin"))


def refill(mib: int, waits: list[float], where: str, out: mp.Queue) -> None:
    block = np.random.default_rng(0).bytes(MIB)
    path = os.path.join(where, "refill.bin")

    def once() -> tuple[float, float]:
        sys0, t = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(block)
        return time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0

    got = []
    for w in waits:
        once()
        os.sync()  # clean pages, as a published chunk's become
        os.unlink(path)
        time.sleep(w)
        got.append((w, *once()))
        os.unlink(path)
    out.put(got)


def cold(
    url: str, options: dict, cache: str, churn_mib: int, sleep_s: float, out: mp.Queue
) -> None:
    from asynccache import CacheDataLoader, StreamingDataset

    # (forked workers, as in a plain script: a spawned process's default is spawn)
    churn(churn_mib, sleep_s)
    c, t = cpu_s(), time.perf_counter()
    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    n = sum(
        len(b)
        for b in CacheDataLoader(ds, batch_size=64, num_workers=2, multiprocessing_context="fork")
    )
    out.put((n / (time.perf_counter() - t), cpu_s() - c))


def run(target, *args) -> object:
    q: mp.Queue = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=(*args, q))
    p.start()
    deadline = time.monotonic() + 600
    while True:
        try:
            got = q.get(timeout=1)
            break
        except queue.Empty:
            if not p.is_alive() or time.monotonic() > deadline:
                p.kill()
                raise SystemExit(f"{target.__name__} failed (exit code {p.exitcode})") from None
    p.join(60)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--churn", type=int, default=1024)
    ap.add_argument("--sleep", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--waits", default="0,5,0.5,3,0,10")
    ap.add_argument("--refill-only", action="store_true")
    args = ap.parse_args()
    import limits
    from shapes import item_array

    print(limits.free_page_reporting() or "no free page reporting")
    with tempfile.TemporaryDirectory(prefix="fresh-pages-") as where:
        waits = [float(w) for w in args.waits.split(",")]
        for w, s, sys_s in run(refill, args.mib, waits, where):
            print(
                f"refill: {args.mib} MiB into a new file {w:g} s after the same was freed: "
                f"{s:.2f} s ({sys_s:.2f} s system)"
            )
    if args.refill_only:
        return

    from asynccache import Settings
    from asynccache.optimize import optimize
    from asynccache.testing import ObjectStore

    work = Path(tempfile.mkdtemp(prefix="fresh-pages-"))
    try:
        n = args.mib * MIB // (100 << 10)
        optimize(
            item_array,
            range(n),
            str(work / "data"),
            num_workers=1,
            chunk_bytes=64 * MIB,
            settings=Settings.from_env(progress=False),
        )
        src = str(max((work / "data").glob("*.bin"), key=lambda f: f.stat().st_size))
        for way in ("np.empty", "fresh_bytes"):
            times = run(fill, way, 256, src)
            print(f"fill 256 MiB, {way}: " + ", ".join(f"{x:.3f}" for x in times) + " s")
        with ObjectStore() as store:
            store.create_bucket("probe")
            import boto3

            client = boto3.client("s3", **store.storage_options)
            for f in (work / "data").iterdir():
                client.upload_file(str(f), "probe", f"d/{f.name}")
            for r in range(args.rounds):
                for c in (args.churn, 0):
                    s, cpu = run(write, args.mib, c, args.sleep, str(work))
                    print(
                        f"round {r}, churn {c} MiB: write {args.mib} MiB to a new file "
                        f"{args.mib / s:,.0f} MiB/s ({cpu:.2f} s CPU)"
                    )
                    cache = str(work / f"cache-{r}-{c}")
                    rate, cpu = run(
                        cold, "s3://probe/d/", store.storage_options, cache, c, args.sleep
                    )
                    shutil.rmtree(cache, ignore_errors=True)
                    print(
                        f"round {r}, churn {c} MiB: cold epoch {rate:,.0f} items/s "
                        f"({cpu:.2f} s CPU, the client's)"
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
