"""Run optimize's shards on an engine of your own: the per-shard API.

``optimize()`` runs the shards on its own process pool (and across torchrun ranks). A
job already on Ray, Dask or Spark can run them there instead: claim the output and plan
the shards with ``start_job``, run ``write_shard(job, fn, inputs[a:b], k)`` for every
shard in ``run.todo`` as that engine's tasks, then ``run.merge()`` commits ``index.json``.

The engine here is ``concurrent.futures.ProcessPoolExecutor`` (the standard library), so
the example runs anywhere; with Ray it is ``ray.get([ray.remote(write_shard).remote(...)
for k in run.todo])``, with Dask ``client.gather(client.map(...))``: the same three calls.

    python examples/optimize_shards_elsewhere.py [--out DIR_OR_URL] [--shards 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import tempfile

import numpy as np

from asynccache import StreamingDataset
from asynccache.optimize import start_job, write_shard


def make(i: int) -> dict:
    """One input -> one item (module level: the engine's workers import it)."""
    return {"i": i, "x": np.full(1000, i, dtype=np.int32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output directory or URL (default: a temp dir)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="optimize-shards-")
    inputs = list(range(args.n))

    # 1. On the driver: claim the output (a lease object) and plan or resume the job.
    with start_job(out, inputs, make, num_shards=args.shards, mode="overwrite") as run:
        job = run.job  # picklable: ship it to the engine's tasks
        # 2. Anywhere: one task per unfinished shard.
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as engine:
            tasks = []
            for k in run.todo:
                a, b = job.bounds(k)
                tasks.append(engine.submit(write_shard, job, make, inputs[a:b], k))
            results = [t.result() for t in tasks]
        # 3. On the driver: merge the shard indexes; index.json is written last.
        index = run.merge()
    print(
        f"{out}: {index.total_items} items in {len(index.chunks)} chunks from {len(results)} shards"
    )
    ds = StreamingDataset(out, cache_dir=tempfile.mkdtemp())
    assert [int(ds[k]["i"]) for k in range(0, len(ds), 499)] == list(range(0, args.n, 499))
    ds.close()


if __name__ == "__main__":
    main()
