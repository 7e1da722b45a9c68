"""How the index's costs grow with the dataset: version 2 (mapped columns) against the
version-1 JSON path, in the same run.

For synthetic indexes of 10k, 100k and 1M chunks (100 items each, one key run each,
names ``chunk-<w>-<n>.bin``) it measures, in fresh processes (the index already on the
local disk, as in a node's cache, pages warm):

* open: ``indexfile.read_dir`` until the index answers ``locate``, beside the limit
  (ii) raw local read of the same index files (a floor for any reader of those bytes);
* index memory per process: the growth of each process's PSS from before the open to
  after it, with ``--procs`` processes holding the index at once (shared pages of a
  mapping are split between them, as on a node), and of its private part (``Pss_Anon``:
  what each further process adds; the mapped pages are the node's page cache, paid once);
* epoch plan, as a rank computes it for 64 ranks x 8 workers: the epoch order
  (chunk permutation, shuffle windows) and this rank's partition, and the first batch
  of keys of each of its workers located in their chunks; the ranks (in separate
  processes) must agree (a digest of the chunk order);
* resume state: the pickled size of a ``StreamingDataset.state_dict()``.

Then an end-to-end run with ``--e2e-chunks`` tiny chunks in a local SeaweedFS: three
processes open the dataset at once with a cold cache (GETs of the sidecar counted by a
proxy) and read 200 items each, once with the version-2 index and once with the same
data's version-1 index.

    .venv/bin/python benchmarks/index_scale.py                       # 10k, 100k, 1M
    .venv/bin/python benchmarks/index_scale.py --sizes 10000 --e2e-chunks 2000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import limits
import numpy as np

from asynccache.cache import indexfile
from asynccache.format import ChunkEntry, Index

ITEMS = 100
CHUNK_BYTES = 64 << 20
WORLD, WORKERS, BATCH = 64, 8, 32


def pss_kib(field: str = "Pss") -> int:
    """This process's proportional set size (or ``Pss_Anon``: its private part), KiB."""
    return limits.rollup(os.getpid()).get(field, 0) >> 10


# -- synthetic indexes --------------------------------------------------------------------
def synthetic(n: int, root: str) -> tuple[str, str]:
    """Write the same n-chunk index as version 1 (``root/v1``) and 2 (``root/v2``)."""
    rng = np.random.default_rng(n)
    items = np.full(n, ITEMS, dtype=np.int64)
    sizes = CHUNK_BYTES - rng.integers(0, 1 << 20, n)
    checks = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    starts = np.concatenate([[0], np.cumsum(items)])
    names = [f"chunk-{c // 100_000}-{c % 100_000}.bin" for c in range(n)]
    v1, v2 = os.path.join(root, "v1"), os.path.join(root, "v2")
    os.makedirs(v1)
    os.makedirs(v2)
    entries = tuple(
        ChunkEntry(name, ITEMS, int(size), f"xxh3_64:{int(ck):016x}", ((int(a), ITEMS),))
        for name, size, ck, a in zip(names, sizes, checks, starts[:-1], strict=True)
    )
    idx = Index(entries, {"chunk_bytes": CHUNK_BYTES, "writer": "benchmarks/index_scale.py"})
    with open(os.path.join(v1, "index.json"), "w") as f:
        f.write(idx.to_json())
    indexfile.write_dir(v2, idx, fsync=False)
    return v1, v2


# -- one measuring process ----------------------------------------------------------------
def child(directory: str, rank: int) -> None:
    """Open the index, plan this rank's epoch, report; then hold it until told to stop."""
    from asynccache.sampling.order import ItemUnits, OrderSpec, ReadOrder
    from asynccache.sampling.partition import plan

    before, anon = pss_kib(), pss_kib("Pss_Anon")
    t0 = time.perf_counter()
    idx = indexfile.read_dir(directory)
    idx.locate_many(np.array([0, idx.total_items - 1]))
    opened = time.perf_counter() - t0
    print(json.dumps({"open_s": opened}), flush=True)
    sys.stdin.readline()  # every measuring process holds its index now
    print(json.dumps({"pss": pss_kib() - before, "anon": pss_kib("Pss_Anon") - anon}), flush=True)
    sys.stdin.readline()  # plan now (one process at a time)
    t0 = time.perf_counter()
    order = ReadOrder(ItemUnits(idx), OrderSpec(seed=17, shuffle=True, window=4), epoch=3)
    p = plan(
        [(0, order.total)],
        world=WORLD,
        rank=rank,
        num_workers=WORKERS,
        batch_size=BATCH,
        drop_last=False,
    )
    firsts = []
    for segs in p.workers:
        s = segs[0]
        keys = order.keys(s.start, min(s.end, s.start + BATCH))
        firsts.append(idx.locate_many(keys)[0])
    planned = time.perf_counter() - t0
    windows = order.spans(0, order.total).chunks  # every chunk, in the order its window is read
    digest = hashlib.sha256(np.ascontiguousarray(windows).tobytes()).hexdigest()[:16]
    print(json.dumps({"plan_s": planned, "digest": digest}), flush=True)
    sys.stdin.readline()


def measure(directory: str, procs: int) -> dict[str, Any]:
    """Open in ``procs`` fresh processes one after another, then PSS with all alive."""
    me = os.path.abspath(__file__)
    running: list[subprocess.Popen[str]] = []

    def ask(p: subprocess.Popen[str]) -> dict[str, Any]:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("\n")
        p.stdin.flush()
        return dict(json.loads(p.stdout.readline()))

    try:
        opened = []
        for r in range(procs):  # one after another: each open is timed alone
            p = subprocess.Popen(
                [
                    sys.executable,
                    me,
                    "--child",
                    directory,
                    "--rank",
                    str(r * (WORLD - 1) // max(1, procs - 1)),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            running.append(p)
            assert p.stdout is not None
            opened.append(json.loads(p.stdout.readline())["open_s"])
        mem = [ask(p) for p in running]  # all of them hold the index
        plans = [ask(p) for p in running]  # one at a time
    finally:
        for p in running:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(60)
    return {
        "open": opened,
        "plan": [f["plan_s"] for f in plans],
        "same": len({f["digest"] for f in plans}) == 1,
        "pss_kib": [m["pss"] for m in mem],
        "anon_kib": [m["anon"] for m in mem],
    }


def raw_read_s(directory: str) -> tuple[int, float]:
    """Limit (ii): read every file of the index (warm page cache), median of 3."""
    paths = [os.path.join(directory, n) for n in os.listdir(directory)]
    runs = [limits.raw_read(paths) for _ in range(3)]
    return runs[0][0], statistics.median(t for _, t in runs)


def resume_bytes(directory: str) -> int:
    from asynccache import StreamingDataset

    ds = StreamingDataset(directory, shuffle=True, seed=1, batch_size=BATCH)
    return len(pickle.dumps(ds.state_dict()))


def fmt(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.3f} {unit} ({min(v):.3f}-{max(v):.3f})"


# -- end to end ---------------------------------------------------------------------------
def e2e_child(url: str, options: str, cache_dir: str, seed: int) -> None:
    from asynccache.config import Settings
    from asynccache.read.reader import Reader
    from asynccache.read.source import DatasetSource

    before = pss_kib("Pss_Anon")
    t0 = time.perf_counter()
    src = DatasetSource(
        url,
        storage_options=json.loads(options),
        settings=Settings.from_env(cache_dir=cache_dir, progress=False),
    )
    opened = time.perf_counter() - t0
    reader = Reader(src.index, src.acquire, release=src.release, max_open=4)
    keys = np.random.default_rng(seed).choice(src.index.total_items, 200, replace=False)
    t0 = time.perf_counter()
    for k in keys.tolist():
        reader.read(*src.index.locate(k))
    read = time.perf_counter() - t0
    reader.close()
    anon = pss_kib("Pss_Anon") - before
    print(json.dumps({"open_s": opened, "read_s": read, "pss": anon}), flush=True)
    src.close()


def end_to_end(chunks: int, root: str) -> list[str]:
    from asynccache.config import Settings
    from asynccache.testing import ObjectStore
    from asynccache.testing.faults import FaultProxy
    from asynccache.write.upload import upload
    from asynccache.write.writer import ChunkWriter, merge_dir

    src = os.path.join(root, "e2e")
    w = ChunkWriter(src, 0, chunk_size=1)
    for i in range(chunks):
        w.add(i, {"i": i, "x": b"y" * 16})
    w.finish()
    merge_dir(src, [0])
    lines = []
    with ObjectStore() as store:
        store.create_bucket("bench")
        url = "s3://bench/e2e"
        t0 = time.perf_counter()
        upload(src, url, store.storage_options, settings=Settings.from_env(progress=False))
        lines.append(f"uploaded {chunks} chunks in {time.perf_counter() - t0:.1f} s")
        v1_text = indexfile.read_dir(src).to_json()
        with FaultProxy(store.endpoint_url) as proxy:
            opts = dict(store.storage_options, endpoint_url=proxy.url)
            for form in ("v2", "v1"):
                if form == "v1":  # the same data, its index in the version-1 form
                    with open(os.path.join(src, "index.json"), "w") as f:
                        f.write(v1_text)
                    upload(
                        src, url, store.storage_options, settings=Settings.from_env(progress=False)
                    )
                before = proxy.count("GET", ".cols")
                cache = os.path.join(root, f"cache-{form}")
                ps = [
                    subprocess.Popen(
                        [
                            sys.executable,
                            os.path.abspath(__file__),
                            "--e2e-child",
                            url,
                            json.dumps(opts),
                            cache,
                            str(i),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    for i in range(3)
                ]
                got = []
                for p in ps:
                    out, _ = p.communicate(timeout=600)
                    got.append(json.loads(out.strip().splitlines()[-1]))
                lines.append(
                    f"{form}: 3 processes opened at once (cold cache): open "
                    f"{fmt([g['open_s'] for g in got])}, 200 random items each "
                    f"{fmt([g['read_s'] for g in got])}, private memory growth "
                    f"{fmt([g['pss'] for g in got], 1 / 1024, 'MiB')}; sidecar GETs: "
                    f"{proxy.count('GET', '.cols') - before}"
                )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--e2e-chunks", type=int, default=20000)
    ap.add_argument("--no-v1-above", type=int, default=10**9, help="skip v1 above N chunks")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--e2e-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rank)
        return
    if args.e2e_child:
        url, opts, cache, seed = args.e2e_child
        e2e_child(url, opts, cache, int(seed))
        return
    print(f"{limits.versions('asynccache', 'numpy')}; {limits.machine()}")
    rows = []
    root = tempfile.mkdtemp(prefix="index_scale-")
    try:
        for n in [int(s) for s in args.sizes.split(",")]:
            d = os.path.join(root, str(n))
            t0 = time.perf_counter()
            v1, v2 = synthetic(n, d)
            print(f"{n} chunks: made both indexes in {time.perf_counter() - t0:.1f} s", flush=True)
            for form, directory in (("v2", v2), ("v1", v1)):
                if form == "v1" and n > args.no_v1_above:
                    continue
                size, floor = raw_read_s(directory)
                m = measure(directory, args.procs)
                res = resume_bytes(directory)
                rows.append(
                    f"| {n:>9,} | {form} | {size / 2**20:8.1f} | {fmt(m['open'])} | "
                    f"{statistics.median(m['open']) / floor:6.1f} | "
                    f"{fmt(m['pss_kib'], 1 / 1024, 'MiB')} | "
                    f"{fmt(m['anon_kib'], 1 / 1024, 'MiB')} | {fmt(m['plan'])} | "
                    f"{'yes' if m['same'] else 'NO'} | {res} |"
                )
                print(rows[-1], flush=True)
            shutil.rmtree(d)
        e2e = end_to_end(args.e2e_chunks, root) if args.e2e_chunks else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nindex_scale ({limits.machine()}), {args.procs} processes per form")
    print(
        "| chunks | index | MiB on disk | open (median, min-max) | open / raw read | "
        "index PSS per process | of it private (Pss_Anon) | plan 64x8, one rank | "
        "same order on all ranks | resume state bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(r)
    for line in e2e:
        print(line)


if __name__ == "__main__":
    main()
