"""How long the end of a streamed epoch waits after its last batch, with persistent workers.

Writes ``--total-mb`` of ``--item-kb`` KiB items in 64 MiB chunks to a SeaweedFS server on
loopback, then, ``--reps`` times, runs ``--epochs`` epochs of one ``CacheDataLoader``
(``persistent_workers=True``, 2 workers, batch 64) over a fresh cache directory, durable
(the default) and with ``durable=False``. Printed per epoch: its time, the time from
``iter()`` to the first batch, and from the last batch to the end of the epoch (the
``StopIteration``: a worker's iteration ends once the chunks it read are published, so a
cold epoch's end waits for the last chunk's fsync).

    python benchmarks/epoch_end.py [--total-mb 256] [--reps 2] [--epochs 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import limits
from streaming_epoch import serve

from asynccache import CacheDataLoader, Settings, StreamingDataset
from asynccache.testing import ObjectStore


def run(url: str, options: dict[str, str], cache: Path, durable: bool, epochs: int) -> list[str]:
    settings = Settings.from_env(progress=False, durable=durable)
    ds = StreamingDataset(url, cache_dir=cache, storage_options=options, settings=settings)
    loader = CacheDataLoader(ds, batch_size=64, num_workers=2, persistent_workers=True)
    out = []
    for e in range(epochs):
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
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    print(f"load {limits.loadavg()}", flush=True)
    try:
        with ObjectStore(volume_size_limit_mb=max(1024, args.total_mb + 256)) as store:
            on = Settings.from_env(progress=False)
            served = serve(
                store, work, args.total_mb << 20, args.item_kb << 10, 64 << 20, on.part_bytes
            )
            options = dict(store.storage_options)
            for rep in range(args.reps):
                for durable in (True, False):
                    cache = work / f"cache-{rep}-{durable}"
                    lines = run(served.url, options, cache, durable, args.epochs)
                    kind = "durable" if durable else "durable=False"
                    for line in lines:
                        print(f"rep {rep} {kind}: {line}; load {limits.loadavg()}", flush=True)
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
