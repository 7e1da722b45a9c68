"""The first epoch after a restart: what checking a durable cache's chunks again costs.

A durable cache stamps each chunk with the boot it was verified in, and after a restart
checks each chunk once against its checksum before its first use (docs/cache.md, "Boot
stamps"). This benchmark fills a cache with one cold epoch from a local S3 server
(``--total-mb`` of ~100 KiB items in 64 MiB chunks), writes it to the disk (``sync``),
then, ``--reps`` times, alternately:

* **from disk**: the page cache dropped (``/proc/sys/vm/drop_caches``, root only), one
  epoch over the cache as it is: every chunk read from the disk, none checked;
* **after a restart**: every chunk given the stamp an earlier boot would have left, the
  page cache dropped, one epoch: every chunk read from the disk and checked (its
  ``xxh3_64`` recomputed) before its first use, then stamped ``synced``.

Both read the same bytes from the same disk; the difference is the check. Reported:
items/s of each, median (min-max), and their ratio within a repetition. Checked after
each restart epoch: every chunk's stamp reads ``synced`` (each was checked and kept; one
fetched again would carry this boot's stamp instead).

    sudo python benchmarks/probes/restart_epoch.py [--total-mb 1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, limits.py

import common
import limits
from common import streaming_loader, timed_epoch

from asynccache import Settings
from asynccache.cache import stamp

EARLIER = b"00000000-0000-4000-8000-000000000000"


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def chunk_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("chunk-*.bin") if p.is_file())


def run(args: argparse.Namespace) -> None:
    settings = Settings.from_env(progress=False)
    if not settings.durable or settings.fsync_publish:
        raise SystemExit("run with the defaults (durable, stamps): nothing to check otherwise")
    with common.served_dataset(args) as (served, work):
        cache = work / "cache"
        loader = streaming_loader(served, cache, False, 0, args.batch, args.workers)
        cold = timed_epoch(loader, served.store.pid, cache)
        files = chunk_files(cache)
        if stamp.read(files[0]) != stamp.boot_id():
            raise SystemExit(f"{files[0]}: not stamped: a file system without xattrs?")
        print(
            f"filled: {served.n_items} items, {len(files)} chunks, cold {cold.rate:,.0f} "
            f"items/s; load {limits.loadavg()}",
            flush=True,
        )
        plain: list[float] = []
        checked: list[float] = []
        for rep in range(args.reps):
            drop_page_cache()
            plain.append(timed_epoch(loader, served.store.pid).rate)
            for p in files:
                os.setxattr(p, stamp.ATTR, EARLIER)
            drop_page_cache()
            started = time.perf_counter()
            e = timed_epoch(loader, served.store.pid)
            checked.append(e.rate)
            stamps = {stamp.read(p) for p in files}
            if stamps != {stamp.SYNCED} or e.items != served.n_items:
                raise SystemExit(f"after the check: stamps {stamps}, {e.items} items")
            print(
                f"rep {rep}: from disk {plain[-1]:,.0f} items/s, after a restart "
                f"{checked[-1]:,.0f} ({time.perf_counter() - started:.2f} s, "
                f"{len(files)} chunks checked); load {limits.loadavg()}",
                flush=True,
            )
        del loader
    ratios = [c / p for c, p in zip(checked, plain, strict=True)]
    print(f"from disk:       {limits.cell(plain)} items/s")
    print(f"after a restart: {limits.cell(checked)} items/s")
    print(f"after a restart / from disk: {limits.cell(ratios, '.2f')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=1024, chunk_mb=64)
    run(ap.parse_args())


if __name__ == "__main__":
    common.quiet()
    main()
