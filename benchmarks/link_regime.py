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
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import limits
from streaming_epoch import BUCKET, Served, serve

from asynccache import CacheDataLoader, Settings, StreamingDataset, prefetch
from asynccache.download.link import forget, link_for, part_bytes_for
from asynccache.testing import ObjectStore


# -- the proxy, in a process of its own --------------------------------------------------
def _proxy_main(upstream: str, conn: Any) -> None:
    from asynccache.testing.faults import FaultProxy

    with FaultProxy(upstream) as proxy:
        conn.send(proxy.url)
        while (msg := conn.recv()) is not None:
            if msg == "log":
                conn.send([(r.method, r.path, r.at, r.ended) for r in proxy.requests])
            elif msg == "records":
                conn.send(proxy.requests)
            else:
                proxy.set_link(**msg)
                conn.send("ok")


class ProxyProcess:
    """A ``FaultProxy`` in a spawned process; its link is set through a pipe."""

    def __init__(self, upstream: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_proxy_main, args=(upstream, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(60):
            raise TimeoutError("the proxy process did not start within 60 s")
        self.url: str = self._conn.recv()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def set_link(self, latency_s: float, conn_bytes_per_s: int) -> None:
        self._conn.send({"latency_s": latency_s, "conn_bytes_per_s": conn_bytes_per_s})
        assert self._conn.poll(10) and self._conn.recv() == "ok"

    def log(self) -> list[tuple[str, str, float, float]]:
        self._conn.send("log")
        assert self._conn.poll(30)
        return self._conn.recv()  # type: ignore[no-any-return]

    def records(self) -> list[Any]:
        """Every request so far, as the proxy's ``RequestRecord`` (first byte, peer)."""
        self._conn.send("records")
        assert self._conn.poll(30)
        return self._conn.recv()  # type: ignore[no-any-return]

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


# -- one link -----------------------------------------------------------------------------
@dataclass
class Link:
    name: str
    latency_s: float
    cap: int  # bytes/s per connection, 0: none
    bare_prefetch: list[float] = field(default_factory=list)  # seconds
    bare_epoch: list[float] = field(default_factory=list)
    one_part: list[float] = field(default_factory=list)
    prefetch: dict[str, list[float]] = field(default_factory=dict)
    startup: dict[str, list[float]] = field(default_factory=dict)
    epoch: dict[str, list[float]] = field(default_factory=dict)
    first: dict[str, list[float]] = field(default_factory=dict)
    timeline: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    estimate: str = ""


def _options(served: Served, endpoint: str) -> dict[str, str]:
    return {**served.store.storage_options, "endpoint_url": endpoint}


def _target(served: Served, endpoint: str) -> limits.S3Target:
    s = served.store
    return limits.S3Target(endpoint, BUCKET, s.access_key, s.secret_key, s.region)


def _bare(served: Served, endpoint: str, parts: list[limits.Part], c: int) -> float:
    return asyncio.run(limits.raw_get(_target(served, endpoint), parts, c))


def _prefetch(
    served: Served, endpoint: str, settings: Settings, cache: Path, proxy: ProxyProcess | None
) -> tuple[float, float, dict[str, float]]:
    """(seconds, start-up seconds: call to the first chunk GET, nan without a proxy; the
    chunk GETs' timeline, see :func:`_timeline`, empty without a proxy)."""
    shutil.rmtree(cache, ignore_errors=True)
    seen = len(proxy.log()) if proxy else 0
    t0 = time.monotonic()
    stats = prefetch(served.url, cache, _options(served, endpoint), settings=settings)
    seconds = time.monotonic() - t0
    assert stats.bytes >= served.payload, (stats.bytes, served.payload)  # + index.json
    startup, timeline = float("nan"), {}
    if proxy is not None:
        log = proxy.log()[seen:]
        startup = min(at for m, p, at, _ in log if m == "GET" and p.endswith(".bin")) - t0
        timeline = _timeline(log, t0, t0 + seconds, settings.max_concurrency)
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
    shutil.rmtree(cache, ignore_errors=True)
    seen = len(proxy.log()) if proxy else 0
    m0 = time.monotonic()
    t0 = time.perf_counter()
    ds = StreamingDataset(
        served.url, cache_dir=cache, storage_options=_options(served, endpoint), settings=settings
    )
    loader = CacheDataLoader(ds, batch_size=batch, num_workers=workers)
    first, items = 0.0, 0
    for b in loader:
        if not items:
            first = time.perf_counter() - t0
        items += len(b)
    seconds = time.perf_counter() - t0
    m1 = time.monotonic()
    assert items == served.n_items, (items, served.n_items)
    del loader, ds
    shutil.rmtree(cache, ignore_errors=True)
    timeline = _timeline(proxy.log()[seen:], m0, m1, concurrency) if proxy else {}
    return seconds, first, timeline


def _timeline(
    log: list[tuple[str, str, float, float]], t0: float, t1: float, concurrency: int
) -> dict[str, float]:
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
    reqs = [(at, ended or t1) for m, p, at, ended in log if m == "GET" and p.endswith(".bin")]
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


def _parse_link(text: str) -> Link:
    ms, _, mbs = text.partition(":")
    return Link(f"{ms} ms, {mbs} MB/s/conn", float(ms) / 1e3, int(float(mbs or 0) * 1e6))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--links", nargs="*", default=["20:4", "50:8"])
    ap.add_argument("--part-mib", type=int, nargs="*", default=[64])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--bare-part-mib", type=int, default=8)
    ap.add_argument("--skip-epoch", action="store_true")
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
        pairs = (item.split("=", 1) for item in variant.split(","))
        env = {**os.environ, **{f"ASYNCCACHE_{k.upper()}": v for k, v in pairs}}
        configs[variant] = Settings.from_env(env, progress=False)
    links = [Link("loopback", 0.0, 0), *map(_parse_link, args.links)]
    c_pre = base.max_concurrency
    c_epoch = args.workers * base.max_concurrency
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    load0 = limits.loadavg()
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            served = serve(
                store,
                work,
                args.total_mb << 20,
                args.item_kb << 10,
                args.chunk_mb << 20,
                args.bare_part_mib << 20,
            )
            proxy = ProxyProcess(store.endpoint_url)
            try:
                for link in links:
                    via = proxy if link.name != "loopback" else None
                    endpoint = proxy.url if via else store.endpoint_url
                    if via:
                        proxy.set_link(link.latency_s, link.cap)
                    forget(endpoint.rstrip("/"))  # the link behind this endpoint changed
                    _measure(link, served, endpoint, via, configs, args, work, c_pre, c_epoch)
                    link.estimate = _estimate(endpoint, base, args.chunk_mb << 20)
                    print(_summary(link), flush=True)
            finally:
                proxy.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(args, links, configs, base, served, c_pre, c_epoch, load0)


def _measure(link, served, endpoint, via, configs, args, work, c_pre, c_epoch) -> None:
    key = served.parts[0][0]
    chunk_end = max(e for k, _, e in served.parts if k == key)
    one = [(key, 0, min(configs["defaults"].part_bytes, chunk_end))]  # one default part
    for _ in range(args.reps):
        link.bare_prefetch.append(_bare(served, endpoint, served.parts, c_pre))
        link.one_part.append(_bare(served, endpoint, one, 1))
        for name, settings in configs.items():
            s, up, tl = _prefetch(served, endpoint, settings, work / "cache", via)
            if tl:
                link.timeline.setdefault(f"prefetch[{name}]", []).append(tl)
            link.prefetch.setdefault(name, []).append(s)
            link.startup.setdefault(name, []).append(up)
        if args.skip_epoch:
            continue
        link.bare_epoch.append(_bare(served, endpoint, served.parts, c_epoch))
        for name, settings in configs.items():
            s, first, tl = _epoch(
                served, endpoint, settings, work / "cache", args.batch, args.workers, via, c_epoch
            )
            link.epoch.setdefault(name, []).append(s)
            link.first.setdefault(name, []).append(first)
            if tl:
                link.timeline.setdefault(f"epoch[{name}]", []).append(tl)


def _estimate(endpoint: str, base: Settings, chunk_bytes: int) -> str:
    """What this process measured of the link, and the part size it chooses from it for
    a chunk of ``chunk_bytes`` with ``PREFETCH_CHUNKS`` chunks ahead (an epoch's steady
    state; prefetch() has more ahead, the start and end of an epoch fewer)."""
    link = link_for(endpoint.rstrip("/"))  # as S3Storage.endpoint spells it
    part = part_bytes_for(base, link, chunk_bytes * max(base.prefetch_chunks, 1))
    return f"{link!r}, part {part / 2**20:.0f} MiB"


def _ratios(limit: list[float], ours: list[float]) -> list[float]:
    return [a / b for a, b in zip(limit, ours, strict=True)]


def _summary(link: Link) -> str:
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


def _report(args, links, configs, base, served, c_pre, c_epoch, load0) -> None:
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
