"""How long the end of a streamed epoch waits after its last batch, with persistent workers.

Writes ``--total-mb`` of ``--item-kb`` KiB items in ``--chunk-mb`` MiB chunks to a SeaweedFS
server on loopback, then, ``--reps`` times, runs ``--epochs`` epochs of one ``CacheDataLoader``
(``persistent_workers=True``, ``--workers``, ``--batch``) over a fresh cache directory, durable
(the default) and with ``durable=False``. Printed per epoch: its time, the time from
``iter()`` to the first batch, and from the last batch to the end of the epoch (the
``StopIteration``: a worker's iteration ends once the chunks it read are published, so a
cold epoch's end waits for the last chunk's fsync).

    python benchmarks/probes/epoch_end.py [--total-mb 256] [--reps 2] [--epochs 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, limits.py

import common
import limits

from asynccache import CacheDataLoader, Settings, StreamingDataset


def run(
    url: str, options: dict[str, str], cache: Path, durable: bool, args: argparse.Namespace
) -> list[str]:
    settings = Settings.from_env(progress=False, durable=durable)
    ds = StreamingDataset(url, cache_dir=cache, storage_options=options, settings=settings)
    loader = CacheDataLoader(
        ds, batch_size=args.batch, num_workers=args.workers, persistent_workers=True
    )
    out = []
    for e in range(args.epochs):
        t0 = time.perf_counter()
        it = iter(loader)
        first = last = None
        for _ in it:
            last = time.perf_counter()
            if first is None:
                first = last
        end = time.perf_counter()
        assert first is not None and last is not None
        out.append(
            f"epoch {e}: {end - t0:.2f} s, first batch {first - t0:.3f} s, "
            f"last batch to end {end - last:.3f} s"
        )
    del loader, it
    ds.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.dataset_args(ap, total_mb=256, chunk_mb=64, reps=2)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    with common.served_dataset(args) as (served, work):
        for rep in range(args.reps):
            for durable in (True, False):
                cache = work / f"cache-{rep}-{durable}"
                lines = run(served.url, served.options_via(), cache, durable, args)
                kind = "durable" if durable else "durable=False"
                for line in lines:
                    print(f"rep {rep} {kind}: {line}; load {limits.loadavg()}", flush=True)
                shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    common.quiet()
    main()
