"""Where the first batch's time goes: a timeline from ``iter()`` to the first batch.

Writes ``--total-mb`` of ``--item-kb`` KiB items in ``--chunk-mb`` MiB chunks to a SeaweedFS
server on loopback and, for cold unshuffled, cold shuffled and warm starts, records (in
every process: the main one and each DataLoader worker) the moments a process reaches each
step: a batch built there (the first), forking the workers and done (main), worker started (``worker_init_fn``), its
``__iter__`` entered and the plan read (``_sync``), ``plan_epoch`` called, storage
connected, chunk store opened, epoch plan built, first GET out (a range read or a chunk
part), first bytes in, range reads done, first chunk fetch out, batch assembled, and the
second batch received (main). Times are milliseconds since ``iter()`` (``time.monotonic``:
one clock for every process of the machine), the first occurrence per process, read after
the fourth batch; then the rest of the epoch is read and its time printed. The steps are
hooked by wrapping the library's functions in this process before the workers fork (this
script only).

    python benchmarks/first_batch_timeline.py [--total-mb 256] [--reps 2]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import limits
import torch.utils.data.dataloader as dlmod
from streaming_epoch import serve

import asynccache.download.downloader as dlmodule
import asynccache.read.reader as readermod
import asynccache.read.source as sourcemod
import asynccache.storage.s3 as s3mod
import asynccache.torch.streaming as smod
from asynccache import CacheDataLoader, Settings, StreamingDataset, prefetch
from asynccache.testing import ObjectStore

_LOG = ""  # the file events are appended to (O_APPEND lines: one write per event)


def _note(what: str) -> None:
    line = f"{os.getpid()} {what} {time.monotonic():.6f}\n".encode()
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _after(obj: Any, name: str, what: str) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        out = fn(*a, **k)
        _note(what)
        return out

    setattr(obj, name, wrapped)


def _before(obj: Any, name: str, what: str) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        _note(what)
        return fn(*a, **k)

    setattr(obj, name, wrapped)


def hook() -> None:
    _before(dlmod._MultiProcessingDataLoaderIter, "__init__", "forking workers")
    _after(dlmod._MultiProcessingDataLoaderIter, "__init__", "workers forked")
    _before(smod.StreamingDataset, "_sync", "iter entered")
    _after(smod.StreamingDataset, "_sync", "plan read")
    _after(sourcemod.DatasetSource, "_connect", "connected")
    _before(sourcemod.DatasetSource, "plan_epoch", "plan_epoch called")
    _after(sourcemod.DatasetSource, "_downloader_of", "store opened")
    _after(sourcemod.DatasetSource, "plan_epoch", "epoch plan built")
    _after(smod.StreamingDataset, "_batch", "batch assembled")
    _after(smod.StreamingDataset, "_lead_batch", "main batch built")
    _after(readermod.Reader, "_fetch_early", "range reads done")
    _before(dlmodule.Downloader, "_fetch", "chunk fetch out")
    impl = s3mod.S3Storage._iter_range_impl

    async def iter_range(self: Any, key: str, start: int, end: int | None) -> Any:
        _note("GET out")
        first = True
        async for piece in impl(self, key, start, end):
            if first:
                _note("first bytes")
                first = False
            yield piece

    s3mod.S3Storage._iter_range_impl = iter_range  # type: ignore[method-assign]


STEPS = (
    "main batch built",
    "forking workers",
    "workers forked",
    "worker started",
    "iter entered",
    "plan read",
    "plan_epoch called",
    "connected",
    "store opened",
    "epoch plan built",
    "GET out",
    "first bytes",
    "range reads done",
    "chunk fetch out",
    "batch assembled",
    "second batch received",
)


def _events(t0: float) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = collections.defaultdict(dict)
    with open(_LOG) as f:
        for line in f:
            pid, *what, t = line.split()
            step = " ".join(what)
            if float(t) >= t0 and step not in out[int(pid)]:
                out[int(pid)][step] = (float(t) - t0) * 1e3
    return out


def once(url: str, options: dict[str, str], cache: Path, shuffle: bool, args: Any) -> str:
    settings = Settings.from_env(progress=False)
    ds = StreamingDataset(
        url, cache_dir=cache, shuffle=shuffle, seed=1, storage_options=options, settings=settings
    )
    loader = CacheDataLoader(
        ds,
        batch_size=args.batch,
        num_workers=args.workers,
        worker_init_fn=lambda _: _note("worker started"),
    )
    open(_LOG, "w").close()
    t0 = time.monotonic()
    it = iter(loader)
    next(it)
    got = (time.monotonic() - t0) * 1e3
    later = []
    for i in range(3):  # the next batches, as a consumer that does nothing else sees them
        next(it)
        if i == 0:
            _note("second batch received")
        later.append(f"{(time.monotonic() - t0) * 1e3:.0f}")
    ev = _events(t0)  # (after the workers' first batches: their steps too)
    n = 4
    for _ in it:  # the rest of the epoch
        n += 1
    epoch = f", the epoch's {n} batches in {(time.monotonic() - t0) * 1e3:.0f} ms"
    del it
    ds.close()
    main = os.getpid()
    rows = []
    for pid in sorted(ev, key=lambda p: (p != main, min(ev[p].values(), default=0))):
        who = "main" if pid == main else f"worker {pid}"
        steps = ", ".join(f"{s} {ev[pid][s]:.0f}" for s in STEPS if s in ev[pid])
        rows.append(f"    {who}: {steps}")
    head = f"  first batch received {got:.0f} ms, the next three at {', '.join(later)} ms"
    head += epoch
    return head + "\n" + "\n".join(rows)


def main() -> None:
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    _LOG = str(work / "events.log")
    hook()
    print(f"load {limits.loadavg()}", flush=True)
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            on = Settings.from_env(progress=False)
            served = serve(
                store,
                work,
                args.total_mb << 20,
                args.item_kb << 10,
                args.chunk_mb << 20,
                on.part_bytes,
            )
            options = dict(store.storage_options)
            for rep in range(args.reps):
                for case in ("cold unshuffled", "cold shuffled", "warm unshuffled"):
                    cache = work / f"cache-{rep}-{case.replace(' ', '-')}"
                    if case.startswith("warm"):
                        prefetch(served.url, cache, options, settings=on)
                    print(f"{case} (rep {rep}, load {limits.loadavg()}):", flush=True)
                    print(once(served.url, options, cache, "shuffled" in case.split(), args))
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
