"""Cold epochs and ``prefetch()`` over links that behave like the cloud, beside loopback.

Loopback hides the two things that set download speed in the cloud: a single connection
is slow (tens of MB/s) and every request waits tens of milliseconds for its first byte.
This script puts the project's ``FaultProxy`` (in a process of its own, so its CPU is not
ours) between the client and a local SeaweedFS server, sets its link knobs (first-byte
latency, per-connection bandwidth cap), and measures in the same run, per link:

* bare GET: a bare aiohttp loop (``limits.raw_get``) fetching every chunk as parts of
  ``--bare-part-mib`` (enough parts to keep every connection busy), at the total concurrency the library may use (``MAX_CONCURRENCY``
  for ``prefetch()``; workers x ``MAX_CONCURRENCY`` for an epoch, each DataLoader worker
  having its own downloader): what the link allows;
* one part: the seconds one bare GET of one default-size part takes on that link;
* ``prefetch()`` of the dataset into a fresh cache dir, and a cold epoch
  (``CacheDataLoader(StreamingDataset(...))``, time to the first batch and to the end),
  with the defaults and with each ``--part-mib`` given (e.g. the old default, 64);
* start-up: from the ``prefetch()`` call to the first chunk GET reaching the proxy (the
  index fetch included, imports excluded).

Reported: each as a ratio to the bare GET loop of the same link, median (min-max) of
``--reps``; first batch as a ratio to the one-part time.

    python benchmarks/link_regime.py [--total-mb 256] [--chunk-mb 64] [--item-kb 100]
        [--links 0:0 20:4 50:8] [--part-mib 64] [--workers 2] [--batch 64] [--reps 2]

A link ``L:C`` is L ms of first-byte latency and C MB/s per connection (0: no cap);
``loopback`` (no proxy at all) is always measured first.
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
from common import Link, ProxyProcess, Served

from asynccache import Settings, prefetch
from asynccache.download.link import forget, link_for, part_bytes_for


@dataclass
class Runs:
    """Every repetition's figures on one link."""

    link: Link
    bare_prefetch: list[float] = field(default_factory=list)  # seconds
    bare_epoch: list[float] = field(default_factory=list)
    one_part: list[float] = field(default_factory=list)
    prefetch: dict[str, list[float]] = field(default_factory=dict)
    startup: dict[str, list[float]] = field(default_factory=dict)
    epoch: dict[str, list[float]] = field(default_factory=dict)
    first: dict[str, list[float]] = field(default_factory=dict)
    timeline: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    estimate: str = ""

    @property
    def name(self) -> str:
        return self.link.name


def bare(served: Served, endpoint: str, parts: list[limits.Part], c: int) -> float:
    """The bare GET loop through ``endpoint``: what the link allows."""
    return asyncio.run(limits.raw_get(served.target_via(endpoint), parts, c))


def _prefetch(
    served: Served, endpoint: str, settings: Settings, cache: Path, proxy: ProxyProcess | None
) -> tuple[float, float, dict[str, float]]:
    """(seconds, start-up seconds: call to the first chunk GET, nan without a proxy; the
    chunk GETs' timeline, see :func:`_timeline`, empty without a proxy)."""
    shutil.rmtree(cache, ignore_errors=True)
    seen = proxy.mark() if proxy else 0
    t0 = time.monotonic()
    stats = prefetch(served.url, cache, served.options_via(endpoint), settings=settings)
    seconds = time.monotonic() - t0
    assert stats.bytes >= served.payload, (stats.bytes, served.payload)  # + index.json
    startup, timeline = float("nan"), {}
    if proxy is not None:
        gets = common.chunk_gets(proxy.records(seen))
        startup = min(r.at for r in gets) - t0
        timeline = _timeline(gets, t0, t0 + seconds, settings.max_concurrency)
    shutil.rmtree(cache, ignore_errors=True)
    return seconds, startup, timeline


def _epoch(
    served: Served,
    endpoint: str,
    settings: Settings,
    cache: Path,
    batch: int,
    workers: int,
    proxy: ProxyProcess | None = None,
    concurrency: int = 1,
) -> tuple[float, float, dict[str, float]]:
    """(seconds, seconds to the first batch, the chunk GETs' timeline through ``proxy``:
    see :func:`_timeline`; empty without a proxy) of one cold epoch."""
    seen = proxy.mark() if proxy else 0
    t0, first, seconds = common.cold_epoch(
        served, cache, batch, workers, settings=settings, endpoint=endpoint
    )
    gets = common.chunk_gets(proxy.records(seen)) if proxy else []
    return seconds, first, _timeline(gets, t0, t0 + seconds, concurrency) if gets else {}


def _timeline(gets: list[Any], t0: float, t1: float, concurrency: int) -> dict[str, float]:
    """Where an epoch's wall time went, from the chunk GETs the proxy saw between ``t0``
    and ``t1`` (monotonic, the same clock in every process):

    * ``start``: seconds from ``t0`` to the first chunk GET (start-up);
    * ``open``: mean requests open from the first GET to the last response's end, as a
      share of ``concurrency`` (1.0: every allowed connection busy all along);
    * ``full``: share of that span with at least 90% of ``concurrency`` open;
    * ``ramp``: seconds from the first GET until 90% of ``concurrency`` are first open;
    * ``drain``: seconds from the last moment 90% were open to the last response's end;
    * ``after``: seconds from the last response's end to ``t1`` (the epoch's own tail).
    """
    reqs = [(r.at, r.ended or t1) for r in gets]
    if not reqs:
        return {}
    first, last = min(a for a, _ in reqs), max(e for _, e in reqs)
    events = sorted([(a, 1) for a, _ in reqs] + [(e, -1) for _, e in reqs])
    high = 0.9 * concurrency
    area = full = 0.0
    opened, prev = 0, first
    reached = last_high = None
    for t, step in events:
        area += opened * (t - prev)
        if opened >= high:
            full += t - prev
            last_high = t
        prev = t
        opened += step
        if opened >= high and reached is None:
            reached = t
    span = max(last - first, 1e-9)
    return {
        "start": first - t0,
        "open": area / span / concurrency,
        "full": full / span,
        "ramp": (reached if reached is not None else last) - first,
        "drain": last - (last_high if last_high is not None else first),
        "after": t1 - last,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=256, chunk_mb=64, reps=2)
    ap.add_argument("--links", nargs="*", default=["20:4", "50:8"], help="L:C, see above")
    ap.add_argument("--part-mib", type=int, nargs="*", default=[64], help="part sizes to try")
    ap.add_argument("--bare-part-mib", type=int, default=8, help="the bare loop's parts")
    ap.add_argument("--skip-epoch", action="store_true", help="prefetch() only")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="more settings to run beside the defaults in every repetition, each "
        "NAME=VALUE[,NAME=VALUE] in ASYNCCACHE_ names without the prefix (HEAD_START=1)",
    )
    args = ap.parse_args()
    base = Settings.from_env(progress=False)
    configs = {"defaults": base}
    for mib in args.part_mib:
        configs[f"part {mib} MiB"] = Settings.from_env(progress=False, part_bytes=mib << 20)
    for variant in args.variants:
        configs[variant] = common.settings_variant(variant, progress=False)
    links = [Runs(Link("loopback", 0.0, 0)), *(Runs(Link.parse(t)) for t in args.links)]
    c_pre = base.max_concurrency
    c_epoch = args.workers * base.max_concurrency
    load0 = limits.loadavg()
    with (
        common.served_dataset(args, args.bare_part_mib << 20) as (served, work),
        ProxyProcess(served.store.endpoint_url) as proxy,
    ):
        for runs in links:
            via = proxy if runs.name != "loopback" else None
            endpoint = proxy.url if via else served.store.endpoint_url
            if via:
                proxy.set_link(runs.link)
            forget(endpoint.rstrip("/"))  # the link behind this endpoint changed
            _measure(runs, served, endpoint, via, configs, args, work, c_pre, c_epoch)
            runs.estimate = _estimate(endpoint, base, args.chunk_mb << 20)
            print(_summary(runs), flush=True)
    _report(args, links, configs, base, served, c_pre, c_epoch, load0)


def _measure(
    runs: Runs,
    served: Served,
    endpoint: str,
    via: ProxyProcess | None,
    configs: dict[str, Settings],
    args: argparse.Namespace,
    work: Path,
    c_pre: int,
    c_epoch: int,
) -> None:
    key = served.parts[0][0]
    chunk_end = max(e for k, _, e in served.parts if k == key)
    one = [(key, 0, min(configs["defaults"].part_bytes, chunk_end))]  # one default part
    for _ in range(args.reps):
        runs.bare_prefetch.append(bare(served, endpoint, served.parts, c_pre))
        runs.one_part.append(bare(served, endpoint, one, 1))
        for name, settings in configs.items():
            s, up, tl = _prefetch(served, endpoint, settings, work / "cache", via)
            if tl:
                runs.timeline.setdefault(f"prefetch[{name}]", []).append(tl)
            runs.prefetch.setdefault(name, []).append(s)
            runs.startup.setdefault(name, []).append(up)
        if args.skip_epoch:
            continue
        runs.bare_epoch.append(bare(served, endpoint, served.parts, c_epoch))
        for name, settings in configs.items():
            s, first, tl = _epoch(
                served, endpoint, settings, work / "cache", args.batch, args.workers, via, c_epoch
            )
            runs.epoch.setdefault(name, []).append(s)
            runs.first.setdefault(name, []).append(first)
            if tl:
                runs.timeline.setdefault(f"epoch[{name}]", []).append(tl)


def _estimate(endpoint: str, base: Settings, chunk_bytes: int) -> str:
    """What this process measured of the link, and the part size it chooses from it for
    a chunk of ``chunk_bytes`` with ``PREFETCH_CHUNKS`` chunks ahead (an epoch's steady
    state; prefetch() has more ahead, the start and end of an epoch fewer)."""
    link = link_for(endpoint.rstrip("/"))  # as S3Storage.endpoint spells it
    part = part_bytes_for(base, link, chunk_bytes * max(base.prefetch_chunks, 1))
    return f"{link!r}, part {part / 2**20:.0f} MiB"


def _ratios(limit: list[float], ours: list[float]) -> list[float]:
    return [a / b for a, b in zip(limit, ours, strict=True)]


def _summary(link: Runs) -> str:
    med = statistics.median
    out = [f"{link.name}: bare {(link.bare_prefetch and med(link.bare_prefetch)) or 0:.2f} s;"]
    for name, s in link.prefetch.items():
        out.append(f"prefetch[{name}] {med(_ratios(link.bare_prefetch, s)):.2f}")
    for name, s in link.epoch.items():
        out.append(
            f"epoch[{name}] {med(_ratios(link.bare_epoch, s)):.2f} first "
            f"{med(link.first[name]):.2f} s"
        )
    for name, tls in link.timeline.items():
        keys = tls[0].keys()
        cells = ", ".join(f"{k} {statistics.median(t[k] for t in tls):.2f}" for k in keys)
        out.append(f"\n  {name} GETs: {cells}")
    out.append(f"\n  estimate: {link.estimate}")
    return " ".join(out) + f"; load {limits.loadavg()}"


def _report(
    args: argparse.Namespace,
    links: list[Runs],
    configs: dict[str, Settings],
    base: Settings,
    served: Served,
    c_pre: int,
    c_epoch: int,
    load0: str,
) -> None:
    print(
        f"\nlink regime: {served.n_items} items x {args.item_kb} KiB "
        f"({served.payload / 2**20:,.0f} MiB) in {args.chunk_mb} MiB chunks; defaults: "
        f"part {'adaptive from ' if base.adaptive_parts else ''}"
        f"{base.part_bytes >> 20} MiB, MAX_CONCURRENCY {base.max_concurrency}, "
        f"PREFETCH_CHUNKS {base.prefetch_chunks}; bare loop at {c_pre} (prefetch) and "
        f"{c_epoch} (epoch: {args.workers} workers) in flight, parts of "
        f"{args.bare_part_mib} MiB; median (min-max) of {args.reps}; {limits.cores()} "
        f"cores, load {load0} -> {limits.loadavg()}; {limits.versions('aiohttp')}"
    )
    print(
        "\n| link | settings | prefetch / bare | start-up ms | cold epoch / bare "
        "| first batch s | first batch / one part | bare prefetch MB/s | one part s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for link in links:
        for name in configs:
            pre = _ratios(link.bare_prefetch, link.prefetch[name])
            up = [x * 1e3 for x in link.startup[name] if x == x]
            ep = _ratios(link.bare_epoch, link.epoch[name]) if link.epoch else []
            first = link.first.get(name, [])
            fpart = [f / p for f, p in zip(first, link.one_part, strict=False)]
            mbs = [served.payload / s / 1e6 for s in link.bare_prefetch]
            print(
                f"| {link.name} | {name} | {limits.cell(pre, '.2f')} | {limits.cell(up, '.0f')} "
                f"| {limits.cell(ep, '.2f')} | {limits.cell(first, '.2f')} "
                f"| {limits.cell(fpart, '.2f')} | {limits.cell(mbs, ',.0f')} "
                f"| {limits.cell(link.one_part, '.2f')} |"
            )


if __name__ == "__main__":
    main()
