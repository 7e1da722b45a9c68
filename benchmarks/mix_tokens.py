"""Token blocks of a 3-dataset mix against one dataset of the same blocks, same run.

Writes a token corpus of ``--total-mb`` MB (uint16 tokens, documents of 200-4000 tokens,
``--chunk-mb`` MiB chunks) to a SeaweedFS server on loopback, twice: once as one dataset,
once cut into three datasets of about a third each. Then, ``--reps`` times, for both:

* cold epoch: a fresh cache dir, ``CacheDataLoader(ds, batch_size, num_workers)`` over
  ``StreamingDataset(url, item_loader=TokenBlocks(2049), shuffle=True)`` (single) or a
  ``MixedDataset`` of the three (weights by size, ``mode=random``);
* warm epoch: the same loader again over the full cache dir;
* the loader ceiling (iii): the same blocks held in RAM, yielded by an ``IterableDataset``
  through a DataLoader with the same workers, batch size and collate.

Reported: blocks/s median (min-max) and, within each repetition, mix / single (the issue's
target: >= 0.9) and each against the loader ceiling; for each epoch also the seconds to
its first batch and the CPU seconds of this process and its DataLoader workers (where a
cold epoch's time goes: a shuffled mix's first batch needs every stream's first window).

    python benchmarks/mix_tokens.py [--total-mb 100] [--chunk-mb 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import limits
import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from asynccache import (
    CacheDataLoader,
    MixedDataset,
    Settings,
    Stream,
    StreamingDataset,
    TokenBlocks,
    optimize,
)
from asynccache.testing import ObjectStore

BLOCK, BUCKET = 2049, "mixbench"


def corpus(total_bytes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs, n = [], 0
    while n < total_bytes:
        d = rng.integers(0, 50_000, int(rng.integers(200, 4000))).astype(np.uint16)
        docs.append(d)
        n += d.nbytes
    return docs


_DOCS: list[np.ndarray] = []


def doc(i: int) -> np.ndarray:
    return _DOCS[i]


class InRam(IterableDataset):
    """The blocks in a list, each worker a contiguous run of whole batches."""

    def __init__(self, blocks: np.ndarray, batch: int) -> None:
        self.blocks, self.batch = blocks, batch

    def __iter__(self) -> Iterator[np.ndarray]:
        info = get_worker_info()
        w, nw = (0, 1) if info is None else (info.id, info.num_workers)
        nb = -(-len(self.blocks) // self.batch)
        for b in range(w, nb, nw):
            yield from self.blocks[b * self.batch : (b + 1) * self.batch]


def epoch(loader: Any) -> tuple[int, float, float, float]:
    """Blocks, seconds, seconds to the first batch, CPU seconds (this process and its
    workers, reaped when the epoch's iterator ends)."""
    clock = limits.CpuClock().start()
    t0, n, first = time.perf_counter(), 0, 0.0
    for batch in loader:
        if not n:
            first = time.perf_counter() - t0
        n += len(batch)
    t = time.perf_counter() - t0
    return n, t, first, clock.stop().client


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mb", type=float, default=100)
    p.add_argument("--chunk-mb", type=float, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    quiet = Settings.from_env(progress=False)
    work = tempfile.mkdtemp(prefix="mixbench-")
    global _DOCS
    _DOCS = corpus(int(a.total_mb * 1e6))
    cuts = np.array_split(np.arange(len(_DOCS)), 3)
    try:
        with ObjectStore() as store:
            store.create_bucket(BUCKET)
            opts = store.storage_options
            chunk = int(a.chunk_mb * (1 << 20))
            single = f"s3://{BUCKET}/single"
            optimize(doc, list(range(len(_DOCS))), single, num_workers=0, chunk_bytes=chunk,
                     tokens="uint16", storage_options=opts, settings=quiet)  # fmt: skip
            parts = []
            for k, cut in enumerate(cuts):
                url = f"s3://{BUCKET}/part{k}"
                optimize(doc, cut.tolist(), url, num_workers=0, chunk_bytes=chunk,
                         tokens="uint16", storage_options=opts, settings=quiet)  # fmt: skip
                parts.append(url)
            flat = np.concatenate(_DOCS)
            blocks = flat[: len(flat) // BLOCK * BLOCK].reshape(-1, BLOCK)

            def stream(url: str, cache: str, seed: int) -> StreamingDataset:
                return StreamingDataset(url, cache_dir=cache, shuffle=True, seed=seed,
                                        storage_options=opts,
                                        item_loader=TokenBlocks(block_size=BLOCK))  # fmt: skip

            def make(kind: str, cache: str) -> CacheDataLoader:
                if kind == "single":
                    ds: StreamingDataset = stream(single, cache, 0)
                else:
                    ss = [stream(u, cache, k) for k, u in enumerate(parts)]
                    ds = MixedDataset([Stream(s, weight=s.epoch_total) for s in ss], seed=0)
                return CacheDataLoader(ds, batch_size=a.batch, num_workers=a.workers)

            rows: dict[str, list[float]] = {}
            ratios: dict[str, list[float]] = {}
            seconds: dict[str, list[tuple[float, float, float]]] = {}
            for _rep in range(a.reps):
                ram = DataLoader(InRam(blocks, a.batch), batch_size=a.batch,
                                 num_workers=a.workers)  # fmt: skip
                n, t, _, _ = epoch(ram)
                ceiling = n / t
                rows.setdefault("ceiling (iii)", []).append(ceiling)
                rate: dict[str, float] = {}
                for kind in ("single", "mix"):
                    cache = os.path.join(work, f"cache-{kind}")
                    shutil.rmtree(cache, ignore_errors=True)
                    dl = make(kind, cache)
                    for phase in ("cold", "warm"):
                        n, t, first, cpu = epoch(dl)
                        rate[f"{kind} {phase}"] = n / t
                        rows.setdefault(f"{kind} {phase}", []).append(n / t)
                        seconds.setdefault(f"{kind} {phase}", []).append((t, first, cpu))
                        ratios.setdefault(f"{kind} {phase} / ceiling", []).append(n / t / ceiling)
                for phase in ("cold", "warm"):
                    ratios.setdefault(f"mix / single, {phase}", []).append(
                        rate[f"mix {phase}"] / rate[f"single {phase}"]
                    )
            print(f"# {blocks.shape[0]} blocks of {BLOCK} uint16 tokens ({blocks.nbytes / 1e6:.0f}"
                  f" MB), {a.chunk_mb} MiB chunks, {a.workers} workers, batch {a.batch}, "
                  f"{a.reps} reps; {limits.cores()} cores, load {limits.loadavg()}")  # fmt: skip
            print(f"# {limits.versions('torch', 'numpy')}")
            print("| figure | blocks/s median (min-max) |\n|---|---|")
            for k, v in rows.items():
                print(f"| {k} | {limits.cell(v)} |")
            print("\n| ratio (within a repetition) | median (min-max) |\n|---|---|")
            for k, v in ratios.items():
                print(f"| {k} | {limits.cell(v, '.2f')} |")
            print("\n| epoch | seconds | first batch (s) | CPU s |\n|---|---|---|---|")
            for k, v in seconds.items():
                cols = [limits.cell([x[i] for x in v], ".2f") for i in range(3)]
                print(f"| {k} | {' | '.join(cols)} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
