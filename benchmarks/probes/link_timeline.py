"""One cold epoch through a capped, distant link, GET by GET, beside the bare GET loop.

Where does a cold epoch leave the link below its capacity? ``link_regime.py`` gives the
ratio; this script gives the time line behind it. Through ``FaultProxy`` (its own
process, link knobs set as in ``link_regime.py``) it runs, per link, the bare GET loop at
the epoch's total concurrency (workers x ``MAX_CONCURRENCY``) and one cold epoch with
the defaults, and prints from the proxy's log:

* every chunk GET of the epoch: arrival, first body byte, end (seconds from the epoch's
  start), its chunk, range and client port;
* requests open in steps of ``--step-ms``, the epoch beside the bare loop (its clock
  starts at its first GET), with the epoch's first batch and end marked;
* the byte-seconds the link lost: for each step, allowed connections minus those open,
  summed (connection-seconds idle), split into before the first chunk GET, while
  GETs run, and after the last byte.

    python benchmarks/probes/link_timeline.py [--total-mb 256] [--chunk-mb 64] [--links 20:4 50:8]
        [--shuffle] [--list]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, limits.py

import common
import limits
from common import Link, ProxyProcess, Served

from asynccache import Settings
from asynccache.download.link import forget


def _gets(records: list[Any], t0: float) -> list[tuple[float, float, float, str, str, int]]:
    out = []
    for r in records:
        if r.method != "GET" or not r.path.endswith(".bin"):
            continue
        end = r.ended or r.at
        out.append(
            (
                r.at - t0,
                (r.first or end) - t0,
                end - t0,
                r.path.rsplit("/", 1)[-1],
                r.range or "",
                r.peer,
            )
        )
    return sorted(out)


def _open_at(gets: list[tuple[float, float, float, str, str, int]], t: float) -> int:
    return sum(1 for a, _, e, *_ in gets if a <= t < e)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=256, chunk_mb=64, reps=1)
    ap.add_argument("--links", nargs="*", default=["20:4", "50:8"], help="L:C (0:0: loopback)")
    ap.add_argument("--bare-part-mib", type=int, default=8)
    ap.add_argument("--step-ms", type=int, default=100)
    ap.add_argument("--list", action="store_true", help="print every GET")
    ap.add_argument("--shuffle", action="store_true", help="a shuffled epoch (seed 0)")
    args = ap.parse_args()
    settings = Settings.from_env(progress=False)
    conc = args.workers * settings.max_concurrency
    print(
        f"load {limits.loadavg()}; {args.total_mb} MiB of {args.item_kb} KiB items in "
        f"{args.chunk_mb} MiB chunks, {args.workers} workers, {conc} connections allowed"
    )
    with (
        common.served_dataset(args, args.bare_part_mib << 20) as (served, work),
        ProxyProcess(served.store.endpoint_url) as proxy,
    ):
        for text in args.links:
            link = Link.parse(text)
            proxy.set_link(link)
            forget(proxy.url.rstrip("/"))
            _one(link.name, served, proxy, settings, args, work, conc)
    print(f"load {limits.loadavg()}")


def _one(
    name: str,
    served: Served,
    proxy: ProxyProcess,
    settings: Settings,
    args: argparse.Namespace,
    work: Path,
    conc: int,
) -> None:
    seen = proxy.mark()
    tb = time.monotonic()
    bare_s = asyncio.run(limits.raw_get(served.target_via(proxy.url), served.parts, conc))
    bare = _gets(proxy.records(seen), tb)
    b0 = min(a for a, *_ in bare)
    bare = [(a - b0, f - b0, e - b0, *rest) for a, f, e, *rest in bare]
    seen = proxy.mark()
    t0, first, end = common.cold_epoch(
        served,
        work / "cache",
        args.batch,
        args.workers,
        shuffle=args.shuffle,
        settings=settings,
        endpoint=proxy.url,
    )
    ep = _gets(proxy.records(seen), t0)
    last = max(e for *_, e, _, _, _ in [(a, f, e, c, r, p) for a, f, e, c, r, p in ep])
    print(
        f"\n== {name}: bare loop {bare_s:.2f} s ({len(bare)} GETs); cold epoch {end:.2f} s "
        f"(ratio {bare_s / end:.2f}), first batch {first:.2f} s, {len(ep)} chunk GETs, "
        f"first GET at {min(a for a, *_ in ep):.2f} s, last byte {last:.2f} s; "
        f"load {limits.loadavg()}"
    )
    if args.list:
        print("  at     first  end    dur   chunk            range                 port")
        for a, f, e, c, r, p in ep:
            print(f"  {a:6.3f} {f:6.3f} {e:6.3f} {e - a:5.2f} {c:16s} {r:21s} {p}")
    step = args.step_ms / 1e3
    print(f"  open requests every {args.step_ms} ms (allowed {conc}): t  epoch  bare")
    idle = {"before": 0.0, "during": 0.0, "after": 0.0}
    first_get = min(a for a, *_ in ep)
    t = 0.0
    while t < max(end, bare_s):
        o, ob = _open_at(ep, t), _open_at(bare, t)
        mark = " <- first batch" if t <= first < t + step else ""
        mark += " <- epoch ends" if t <= end < t + step else ""
        print(f"  {t:5.2f} {o:4d} {ob:4d} {'#' * o}{mark}")
        if t < end:
            phase = "before" if t < first_get else "during" if t < last else "after"
            idle[phase] += (conc - min(o, conc)) * step
        t += step
    print(
        "  connection-seconds idle in the epoch: "
        + ", ".join(f"{k} {v:.1f}" for k, v in idle.items())
        + f" (the bare loop's whole run: "
        f"{conc * bare_s:.1f} connection-seconds)"
    )


if __name__ == "__main__":
    common.quiet()
    main()
