"""Two epochs under a cache budget, over a matrix of shapes: bytes fetched per epoch.

One SeaweedFS server on loopback and one fault proxy (no faults) in front of it; for each
shape a dataset is written and uploaded once, then for each reading setup two epochs are
read through a fresh cache dir. Whole-chunk downloads (a GET without a range, or of one
whole part) are counted per epoch at the proxy, as a fraction of the dataset; the first
items a reader fetches by range before their chunks land (never cached) apart.

    python benchmarks/probes/budget_matrix.py --chunks 18,82 --chunk-kb 64 \
        --fractions 0.25,0.5,0.75 --workers 0,2,8 --orders o,s [--persistent]

Prints one line per setup: epoch 1 and epoch 2 fetched / dataset, the target for epoch 2
(1.1 x (1 - fraction)), and the bound the tests assert where the target is out of reach
(asynccache.cache.plan.warm_bound).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
import uuid

import numpy as np
import torch

from asynccache import CacheDataLoader, ConfigError, StreamingDataset, upload
from asynccache.config import Settings
from asynccache.read.readplan import ReaderPlace, budget_bounds
from asynccache.testing.faults import FaultProxy
from asynccache.testing.objstore import ObjectStore
from asynccache.write.writer import ChunkWriter, merge_dir


def downloads(records, sizes: dict[str, int], part: int) -> tuple[int, int]:
    """(bytes of whole-chunk downloads, bytes of other ranged GETs) of chunk files."""
    whole = ranged = 0
    for r in records:
        name = os.path.basename(r.path)
        if r.method != "GET" or name not in sizes:
            continue
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", r.range or "")
        if m is None:
            whole += sizes[name]
            continue
        a, b = int(m.group(1)), int(m.group(2)) + 1
        b = min(b, sizes[name])
        if a % part == 0 and b == min(a + part, sizes[name]):
            whole += b - a
        else:
            ranged += b - a
    return whole, ranged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="18,82")
    ap.add_argument("--chunk-kb", type=int, default=64)
    ap.add_argument("--items-per-chunk", type=int, default=640)
    ap.add_argument("--fractions", default="0.25,0.5,0.75")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--orders", default="o,s")
    ap.add_argument("--persistent", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--window", type=int, default=4)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    part = Settings().part_bytes
    with ObjectStore() as store, FaultProxy(store.endpoint_url) as proxy:
        for n in [int(x) for x in args.chunks.split(",")]:
            per = args.items_per_chunk
            item = max(1, (args.chunk_kb << 10) // per - 40)
            src = os.path.join(tmp, f"src-{n}")
            w = ChunkWriter(src, 0, chunk_bytes=args.chunk_kb << 10)
            rng = np.random.default_rng(0)
            for i in range(n * per):
                w.add(i, {"i": i, "x": rng.integers(0, 255, item, dtype=np.uint8)})
            w.finish()
            index = merge_dir(src, [0])
            sizes = {c.filename: c.bytes for c in index.chunks}
            total = sum(sizes.values())
            bucket = f"m{uuid.uuid4().hex[:8]}"
            store.create_bucket(bucket)
            url = f"s3://{bucket}/ds"
            upload(src, url, store.storage_options, settings=Settings.from_env(progress=False))
            opts = dict(store.storage_options, endpoint_url=proxy.url)
            for frac in [float(x) for x in args.fractions.split(",")]:
                for nw in [int(x) for x in args.workers.split(",")]:
                    for o in args.orders.split(","):
                        cache = os.path.join(tmp, f"cache-{uuid.uuid4().hex[:8]}")
                        budget = int(total * frac)
                        line = f"chunks={index.num_chunks} frac={frac} workers={nw} order={o}"
                        try:
                            ds = StreamingDataset(
                                url,
                                cache_dir=cache,
                                shuffle=o == "s",
                                shuffle_window=args.window,
                                seed=3,
                                max_cache_bytes=budget,
                                storage_options=opts,
                            )
                            kw = {"persistent_workers": True} if args.persistent and nw else {}
                            dl = CacheDataLoader(ds, batch_size=args.batch, num_workers=nw, **kw)
                            got = []
                            for _ in range(2):
                                before = len(proxy.requests)
                                t0 = time.monotonic()
                                keys = torch.cat([b["i"] for b in dl]).tolist()
                                dt = time.monotonic() - t0
                                assert sorted(keys) == list(range(n * per)), "items lost"
                                whole, ranged = downloads(proxy.requests[before:], sizes, part)
                                got.append(f"{whole / total:.3f} (+{ranged / total:.3f}) {dt:.1f}s")
                            place = ReaderPlace(
                                epoch=0,
                                remaining=(),
                                received=0,
                                world=1,
                                rank=0,
                                num_workers=max(1, nw),
                                worker=0,
                                batch_size=args.batch,
                                drop_last=False,
                            )
                            spec = ds.epoch_spec(place)
                            cold, warm = budget_bounds(ds.index, spec, budget)
                            ds.close()
                            target = 1.1 * (1 - frac)
                            print(
                                f"{line} window={spec.order.window}: epoch 1 {got[0]} "
                                f"(bound {cold / total:.3f})  epoch 2 {got[1]} (bound "
                                f"{warm / total:.3f}, target {target:.3f})",
                                flush=True,
                            )
                        except ConfigError as exc:
                            print(f"{line}: ConfigError {str(exc)[:160]}", flush=True)


if __name__ == "__main__":
    main()
