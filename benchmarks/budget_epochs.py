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
import multiprocessing
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import limits
from streaming_epoch import Served, quiet, serve

from asynccache import CacheDataLoader, ConfigError, Settings, StreamingDataset
from asynccache.testing import ObjectStore
from asynccache.testing.faults import FaultProxy

BUDGETS = (None, 1.0, 0.5, 0.25)  # None: unbounded


def proxy_main(upstream: str, conn: Connection) -> None:
    """Serve a counting proxy until told to stop; answer ``"count"`` with the GETs per
    chunk file since the last count."""
    with FaultProxy(upstream) as proxy:
        conn.send(proxy.url)
        seen = 0
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                return
            log = proxy.requests
            gets: dict[str, list[str | None]] = collections.defaultdict(list)
            for r in log[seen:]:
                name = os.path.basename(r.path)
                if r.method == "GET" and name.startswith("chunk-"):
                    gets[name].append(r.range)
            seen = len(log)
            conn.send(dict(gets))


class Counter:
    """The counting proxy in a child process (so its relaying does not hold our GIL)."""

    def __init__(self, upstream: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=proxy_main, args=(upstream, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(60):
            raise SystemExit("the counting proxy did not start")
        self.url: str = self._conn.recv()

    def take(self) -> dict[str, list[str | None]]:
        """The Range header (None: none) of each chunk GET since the last take, by name."""
        self._conn.send("count")
        if not self._conn.poll(60):
            raise SystemExit("the counting proxy did not answer")
        got: dict[str, list[str | None]] = self._conn.recv()
        return got

    def close(self) -> None:
        self._conn.send("stop")
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


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


def chunk_sizes(served: Served) -> dict[str, int]:
    """Bytes of each chunk file, by name."""
    sizes: dict[str, int] = collections.Counter()
    for key, start, end in served.parts:
        sizes[os.path.basename(key)] += end - start
    return dict(sizes)


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
    counter: Counter,
    proxy_url: str,
    cache: Path,
    budget: int | None,
    shuffle: bool,
    seed: int,
    args: argparse.Namespace,
) -> list[tuple[float, float, int, float]]:
    """(bytes of whole chunks fetched ÷ dataset, MiB/s, chunks fetched twice, bytes read by
    range ÷ dataset) of two epochs."""
    sizes = chunk_sizes(served)
    out = []
    counter.take()
    started = time.perf_counter()
    ds = StreamingDataset(
        served.url,
        cache_dir=cache,
        shuffle=shuffle,
        seed=seed,
        max_cache_bytes=budget,
        storage_options=dict(served.store.storage_options, endpoint_url=proxy_url),
    )
    loader = CacheDataLoader(ds, batch_size=args.batch, num_workers=args.workers)
    for _ in range(2):
        items = sum(len(b) for b in loader)
        seconds = time.perf_counter() - started
        if items != served.n_items:
            raise SystemExit(f"an epoch yielded {items} of {served.n_items} items")
        whole, ranged = split_gets(counter.take(), sizes, ds.settings.part_bytes)
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
    per_chunk = -(-(args.chunk_mb << 20) // settings.part_bytes)
    concurrency = args.workers * max(
        1, min(settings.max_concurrency, settings.prefetch_chunks * per_chunk)
    )
    work = Path(tempfile.mkdtemp(prefix="asynccache-budget-"))
    rows = {(s, b): Row() for s in (False, True) for b in BUDGETS}
    raw: list[float] = []
    raw_proxy: list[float] = []
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            served = serve(
                store,
                work,
                args.total_mb << 20,
                args.item_kb << 10,
                args.chunk_mb << 20,
                settings.part_bytes,
            )
            counter = Counter(store.endpoint_url)
            try:
                via = limits.S3Target(
                    counter.url, "bench", store.access_key, store.secret_key, store.region
                )
                mib = served.payload / 2**20
                print(
                    f"dataset: {served.n_items} items x {args.item_kb} KiB, {mib:,.0f} MiB in "
                    f"{len(chunk_sizes(served))} chunks of {args.chunk_mb} MiB; {args.workers} workers, "
                    f"batch {args.batch}; raw GET concurrency {concurrency}",
                    flush=True,
                )
                for rep in range(args.reps):
                    raw.append(mib / limits.raw_get_sync(served.target, served.parts, concurrency))
                    raw_proxy.append(mib / limits.raw_get_sync(via, served.parts, concurrency))
                    counter.take()
                    for shuffle in (False, True):
                        unbounded = 0.0
                        for b in BUDGETS:
                            budget = None if b is None else int(served.payload * b)
                            cache = work / f"cache-{rep}-{int(shuffle)}-{b}"
                            row = rows[(shuffle, b)]
                            try:
                                eps = two_epochs(
                                    served, counter, counter.url, cache, budget, shuffle, rep, args
                                )
                            except ConfigError as exc:  # below the minimum: refused at start
                                found = re.search(r"minimum of (\d+) bytes", str(exc))
                                row.below = int(found.group(1)) if found else -1
                                print(
                                    f"rep {rep} shuffle={shuffle} budget={b}: refused", flush=True
                                )
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
            finally:
                counter.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
        f"{len(chunk_sizes(served))} chunks of {args.chunk_mb} MiB, {args.workers} workers, batch "
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
    ap.add_argument("--total-mb", type=int, default=256, help="dataset size, MiB")
    ap.add_argument("--chunk-mb", type=int, default=1, help="chunk size, MiB")
    ap.add_argument("--item-kb", type=int, default=100, help="item size, KiB")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    run(ap.parse_args())


if __name__ == "__main__":
    quiet()
    main()
