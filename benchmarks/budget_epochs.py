"""Two epochs of ``StreamingDataset`` under cache budgets smaller than the dataset.

Writes ``--total-mb`` of ~``--item-kb`` KiB incompressible items as ``--chunk-mb`` MiB
chunks, uploads them to a SeaweedFS server on loopback and, for shuffle off and on, each
repetition, reads two epochs through one ``CacheDataLoader`` (fresh cache dir) for each
budget: unbounded (the default 50 GiB), then 1.0, 0.5 and 0.25 of the dataset's bytes.

Every GET goes through a fault proxy (no faults) that runs in a process of its own and
counts the GETs of each chunk, so *bytes fetched ÷ dataset* counts the whole chunks every
DataLoader worker downloaded; the first items a reader fetches by range before their
chunks land (``ASYNCCACHE_FIRST_READ_BYTES``, never cached) are counted apart. In the same run, the limits: (i) raw GET, every chunk fetched by a bare
aiohttp loop (``limits.raw_get``) straight from the store, and again through the proxy,
at the concurrency a cold epoch can have in flight.

Reported per shuffle setting and budget, median (min-max) over ``--reps``: bytes fetched ÷
dataset and MiB/s of epoch 1 (cold) and epoch 2, the cold epoch's MiB/s ÷ the unbounded
cold epoch's (same repetition), and the targets: epoch 1 fetches 1.0; epoch 2 at most
1.1 x (1 - budget).

    python benchmarks/budget_epochs.py [--total-mb 256] [--chunk-mb 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
import limits
from common import ProxyProcess, Served

from asynccache import CacheDataLoader, ConfigError, Settings, StreamingDataset

BUDGETS = (None, 1.0, 0.5, 0.25)  # None: unbounded


def take_gets(proxy: ProxyProcess, since: int) -> tuple[dict[str, list[str | None]], int]:
    """The Range header (None: none) of each chunk GET the proxy saw from the ``since``-th
    request on, by chunk file name; and the mark for the next call."""
    records = proxy.records(since)
    gets: dict[str, list[str | None]] = collections.defaultdict(list)
    for r in common.chunk_gets(records):
        gets[os.path.basename(r.path)].append(r.range)
    return dict(gets), since + len(records)


def split_gets(
    gets: dict[str, list[str | None]], sizes: dict[str, int], part: int
) -> tuple[collections.Counter[str], int]:
    """Whole-chunk downloads per chunk (a GET without a range or of one whole part, from a
    part boundary to the next or the chunk's end; a chunk's parts count once each), and the
    bytes of the other GETs: a reader's range reads of its first items before their
    chunks land (``ASYNCCACHE_FIRST_READ_BYTES``), never cached."""
    whole: collections.Counter[str] = collections.Counter()
    ranged = 0
    for name, ranges in gets.items():
        parts = 0
        for rng in ranges:
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
            if m is None:
                parts += -(-sizes[name] // part)
                continue
            start, end = int(m.group(1)), int(m.group(2)) + 1
            if start % part == 0 and end == min(start + part, sizes[name]):
                parts += 1
            else:
                ranged += end - start
        whole[name] = -(-parts // -(-sizes[name] // part))  # downloads: parts / parts per chunk
    return whole, ranged


@dataclass
class Row:
    fetched: list[list[float]] = field(default_factory=lambda: [[], []])  # per epoch
    rate: list[list[float]] = field(default_factory=lambda: [[], []])  # MiB/s per epoch
    vs_unbounded: list[float] = field(default_factory=list)  # cold MiB/s ÷ unbounded's
    twice: int = 0  # chunks fetched more than once in one epoch, all reps
    ranged: list[float] = field(default_factory=list)  # epoch 1's range reads ÷ dataset
    below: int = 0  # the minimum budget, when this budget was refused as below it


def two_epochs(
    served: Served,
    proxy: ProxyProcess,
    cache: Path,
    budget: int | None,
    shuffle: bool,
    seed: int,
    args: argparse.Namespace,
) -> list[tuple[float, float, int, float]]:
    """(bytes of whole chunks fetched ÷ dataset, MiB/s, chunks fetched twice, bytes read by
    range ÷ dataset) of two epochs."""
    sizes = served.chunk_sizes()
    out = []
    mark = proxy.mark()
    started = time.perf_counter()
    ds = StreamingDataset(
        served.url,
        cache_dir=cache,
        shuffle=shuffle,
        seed=seed,
        max_cache_bytes=budget,
        storage_options=served.options_via(proxy.url),
    )
    loader = CacheDataLoader(ds, batch_size=args.batch, num_workers=args.workers)
    for _ in range(2):
        items = sum(len(b) for b in loader)
        seconds = time.perf_counter() - started
        if items != served.n_items:
            raise SystemExit(f"an epoch yielded {items} of {served.n_items} items")
        gets, mark = take_gets(proxy, mark)
        whole, ranged = split_gets(gets, sizes, ds.settings.part_bytes)
        fetched = sum(sizes[name] * n for name, n in whole.items())
        out.append(
            (
                fetched / served.payload,
                served.payload / 2**20 / seconds,
                sum(1 for n in whole.values() if n > 1),
                ranged / served.payload,
            )
        )
        started = time.perf_counter()
    ds.close()
    del loader
    shutil.rmtree(cache, ignore_errors=True)
    return out


def run(args: argparse.Namespace) -> None:
    settings = Settings.from_env(progress=False)
    concurrency = common.epoch_concurrency(settings, args.chunk_mb << 20, args.workers)
    rows = {(s, b): Row() for s in (False, True) for b in BUDGETS}
    raw: list[float] = []
    raw_proxy: list[float] = []
    with (
        common.served_dataset(args) as (served, work),
        ProxyProcess(served.store.endpoint_url) as proxy,
    ):
        via = served.target_via(proxy.url)
        mib = served.payload / 2**20
        print(
            f"{args.workers} workers, batch {args.batch}; raw GET concurrency {concurrency}",
            flush=True,
        )
        for rep in range(args.reps):
            raw.append(mib / limits.raw_get_sync(served.target, served.parts, concurrency))
            raw_proxy.append(mib / limits.raw_get_sync(via, served.parts, concurrency))
            for shuffle in (False, True):
                unbounded = 0.0
                for b in BUDGETS:
                    budget = None if b is None else int(served.payload * b)
                    cache = work / f"cache-{rep}-{int(shuffle)}-{b}"
                    row = rows[(shuffle, b)]
                    try:
                        eps = two_epochs(served, proxy, cache, budget, shuffle, rep, args)
                    except ConfigError as exc:  # below the minimum: refused at start
                        found = re.search(r"minimum of (\d+) bytes", str(exc))
                        row.below = int(found.group(1)) if found else -1
                        print(f"rep {rep} shuffle={shuffle} budget={b}: refused", flush=True)
                        shutil.rmtree(cache, ignore_errors=True)
                        continue
                    for e, (fetched, rate, twice, ranged) in enumerate(eps):
                        row.fetched[e].append(fetched)
                        row.rate[e].append(rate)
                        if e == 0:
                            row.twice += twice
                            row.ranged.append(ranged)
                    if b is None:
                        unbounded = eps[0][1]
                    row.vs_unbounded.append(eps[0][1] / unbounded)
                    print(
                        f"rep {rep} shuffle={shuffle} budget={b or 'unbounded'}: "
                        f"fetched {eps[0][0]:.2f} / {eps[1][0]:.2f}, MiB/s "
                        f"{eps[0][1]:,.0f} / {eps[1][1]:,.0f}; by range {eps[0][3]:.3f} / "
                        f"{eps[1][3]:.3f}; load {limits.loadavg()}",
                        flush=True,
                    )
    report(args, served, rows, raw, raw_proxy)


def report(
    args: argparse.Namespace,
    served: Served,
    rows: dict[tuple[bool, float | None], Row],
    raw: list[float],
    raw_proxy: list[float],
) -> None:
    mib = served.payload / 2**20
    print(
        f"\nbudget epochs: {served.n_items} items x {args.item_kb} KiB ({mib:,.0f} MiB) in "
        f"{len(served.chunk_sizes())} chunks of {args.chunk_mb} MiB, {args.workers} workers, batch "
        f"{args.batch}, {len(raw)} reps; {limits.cores()} cores, load {limits.loadavg()}; "
        f"{limits.versions('torch', 'aiohttp')}"
    )
    print(
        f"raw GET limit: {limits.cell(raw)} MiB/s straight to the store, "
        f"{limits.cell(raw_proxy)} MiB/s through the counting proxy (the epochs' path)\n"
    )
    print(
        "| shuffle | budget | epoch 1 fetched ÷ dataset | epoch 1 MiB/s | epoch 1 ÷ unbounded "
        "| epoch 1 ÷ raw GET (proxy) | epoch 2 fetched ÷ dataset | target ≤ | epoch 2 MiB/s "
        "| chunks fetched twice in epoch 1 | epoch 1 read by range ÷ dataset |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (shuffle, b), row in rows.items():
        if row.below:
            label = "unbounded" if b is None else f"{b:g}"
            print(
                f"| {'on' if shuffle else 'off'} | {label} | refused: below the minimum of "
                f"{row.below / served.payload:.2f} x dataset | | | | | | | | |"
            )
            continue
        target = "-" if b is None else f"{1.1 * max(0.0, 1 - b):.3f}"
        vs_raw = [r / g for r, g in zip(row.rate[0], raw_proxy, strict=True)]
        cells = [
            "on" if shuffle else "off",
            "unbounded" if b is None else f"{b:g}",
            limits.cell(row.fetched[0], ".2f"),
            limits.cell(row.rate[0]),
            limits.cell(row.vs_unbounded, ".2f"),
            limits.cell(vs_raw, ".2f"),
            limits.cell(row.fetched[1], ".3f"),
            target,
            limits.cell(row.rate[1]),
            str(row.twice),
            limits.cell(row.ranged, ".3f"),
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=256, chunk_mb=1)
    run(ap.parse_args())


if __name__ == "__main__":
    common.quiet()
    main()
