"""The workload side every benchmark shares: a dataset on a local object store, the same
items in RAM for the loader ceiling, one timed epoch, the fault proxy in a process of its
own, and the options the scripts take.

The limits of the machine and the instruments (CPU clocks, memory samplers) are in
``limits.py``; this module builds the workloads they are measured against. Import it from a
script in this directory as ``import common`` (a probe in ``probes/`` puts this directory on
``sys.path`` first).

Every dataset here is incompressible (random bytes), written by the library's own writer,
uploaded to a SeaweedFS server on loopback that the script starts and stops, and deleted
with the script's temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import limits
import numpy as np
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from asynccache import CacheDataLoader, Settings, StreamingDataset, upload
from asynccache.testing import ObjectStore
from asynccache.write.writer import ChunkWriter, merge_dir

BUCKET = "bench"
PREFIX = "ds"


# -- the dataset ---------------------------------------------------------------------------
def make_items(n: int, item_bytes: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` random ``uint8`` arrays of ``item_bytes``, views of one buffer; same seed, same items."""
    buf = np.frombuffer(np.random.default_rng(seed).bytes(n * item_bytes), dtype=np.uint8)
    return [buf[i * item_bytes : (i + 1) * item_bytes] for i in range(n)]


def write_dataset(directory: Path, items: Iterable[Any], chunk_bytes: int) -> Any:
    """Items as chunks + ``index.json`` in ``directory`` (one writer); returns the index."""
    w = ChunkWriter(str(directory), 0, chunk_bytes=chunk_bytes)
    for i, item in enumerate(items):
        w.add(i, item)
    w.finish()
    return merge_dir(str(directory), [0])


@dataclass
class Served:
    """A dataset on a running object store."""

    store: ObjectStore
    url: str
    n_items: int
    item_bytes: int
    payload: int  # bytes of the chunk files
    parts: list[limits.Part]  # every chunk object as ranged GETs of the part size asked for

    @property
    def target(self) -> limits.S3Target:
        """The bare loop's target: the store itself."""
        return limits.S3Target.of(self.store, BUCKET)

    def target_via(self, endpoint: str) -> limits.S3Target:
        """The bare loop's target through another endpoint (a proxy) to the same bucket."""
        s = self.store
        return limits.S3Target(endpoint, BUCKET, s.access_key, s.secret_key, s.region)

    def options_via(self, endpoint: str | None = None) -> dict[str, str]:
        """``storage_options`` for the library, through ``endpoint`` (default: the store)."""
        out = dict(self.store.storage_options)
        if endpoint is not None:
            out["endpoint_url"] = endpoint
        return out

    def chunk_sizes(self) -> dict[str, int]:
        """Bytes of each chunk file, by file name."""
        sizes: dict[str, int] = {}
        for key, start, end in self.parts:
            name = os.path.basename(key)
            sizes[name] = sizes.get(name, 0) + end - start
        return sizes


def serve(
    store: ObjectStore,
    work: Path,
    total_bytes: int,
    item_bytes: int,
    chunk_bytes: int,
    part_bytes: int,
) -> Served:
    """Write, upload and describe the benchmark dataset (the local copy is deleted)."""
    n = max(1, total_bytes // item_bytes)
    src = work / "src"
    index = write_dataset(src, make_items(n, item_bytes), chunk_bytes)
    store.create_bucket(BUCKET)
    url = f"s3://{BUCKET}/{PREFIX}"
    upload(src, url, store.storage_options, settings=Settings.from_env(progress=False))
    shutil.rmtree(src)
    parts = [
        p for c in index.chunks for p in limits.split(f"{PREFIX}/{c.filename}", c.bytes, part_bytes)
    ]
    payload = sum(c.bytes for c in index.chunks)
    return Served(store, url, n, item_bytes, payload, parts)


@contextlib.contextmanager
def served_dataset(
    args: argparse.Namespace, part_bytes: int | None = None
) -> Iterator[tuple[Served, Path]]:
    """:func:`serve` of the dataset :func:`dataset_args` describe on a fresh object store,
    with the temporary directory the script works in; the GET parts are ``part_bytes``
    (default: the downloader's part size)."""
    if part_bytes is None:
        part_bytes = Settings.from_env(progress=False).part_bytes
    with limits.object_store(args.total_mb) as (store, work):
        t0 = time.perf_counter()
        served = serve(
            store, work, args.total_mb << 20, args.item_kb << 10, args.chunk_mb << 20, part_bytes
        )
        print(
            f"dataset: {served.n_items} items x {args.item_kb} KiB "
            f"({served.payload / 2**20:,.0f} MiB) in {args.chunk_mb} MiB chunks, "
            f"{len(served.chunk_sizes())} chunks; written and uploaded in "
            f"{time.perf_counter() - t0:.1f} s; load {limits.loadavg()}",
            flush=True,
        )
        yield served, work


def dataset_args(
    ap: argparse.ArgumentParser,
    *,
    total_mb: int,
    chunk_mb: int,
    item_kb: int = 100,
    reps: int = 3,
    batch: int = 64,
    workers: int = 2,
) -> None:
    """The options every dataset benchmark takes, with this script's defaults."""
    ap.add_argument("--total-mb", type=int, default=total_mb, help="dataset size, MiB")
    ap.add_argument("--chunk-mb", type=int, default=chunk_mb, help="chunk size, MiB")
    ap.add_argument("--item-kb", type=int, default=item_kb, help="item size, KiB")
    ap.add_argument("--batch", type=int, default=batch, help="batch size")
    ap.add_argument("--workers", type=int, default=workers, help="DataLoader workers")
    ap.add_argument("--reps", type=int, default=reps, help="repetitions (median, min-max)")


def epoch_concurrency(settings: Settings, chunk_bytes: int, workers: int) -> int:
    """GETs a cold epoch can have in flight: each worker's downloader runs at most
    ``MAX_CONCURRENCY``, and has at most ``PREFETCH_CHUNKS`` chunks of parts to fetch."""
    per_chunk = -(-chunk_bytes // settings.part_bytes)
    return max(1, workers) * max(
        1, min(settings.max_concurrency, settings.prefetch_chunks * per_chunk)
    )


# -- the loader ceiling (iii): the items in RAM ----------------------------------------------
class ListIterable(IterableDataset[Any]):
    """Items held in memory, yielded like ``StreamingDataset`` does: the loader ceiling (iii).

    Each DataLoader worker yields whole batches, worker ``j`` the batches ``j, j + W, ...``
    of the epoch order (a permutation from ``seed`` when shuffling), so the DataLoader's
    round robin receives them in order, as from the streaming dataset.
    """

    def __init__(self, items: list[Any], batch: int, shuffle: bool, seed: int) -> None:
        self.items, self.batch, self.shuffle, self.seed = items, batch, shuffle, seed

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        n = len(self.items)
        order = np.random.default_rng(self.seed).permutation(n) if self.shuffle else range(n)
        for start in range(w * self.batch, n, nw * self.batch):
            for i in order[start : start + self.batch]:
                yield self.items[i]


class ListDataset(Dataset[Any]):
    """Items held in memory, map-style (indices sent to the workers by the DataLoader)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


# -- one epoch -----------------------------------------------------------------------------
@dataclass
class Epoch:
    items: int = 0
    first_batch_s: float = 0.0
    seconds: float = 0.0
    cpu_client: float = 0.0
    cpu_store: float = 0.0
    peak_mem: int = 0
    peak_anon: int = 0
    peak_dir: int = 0

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def timed_epoch(
    batches: Iterable[Any],
    store_pid: int,
    cache_dir: Path | None = None,
    start: float | None = None,
) -> Epoch:
    """Iterates ``batches`` to the end (workers reaped); ``start``: when the clock started.

    Items are counted with ``len(batch)`` (a batch of token blocks counts its blocks)."""
    clock = limits.CpuClock(store_pid).start()
    started = time.perf_counter() if start is None else start
    out = Epoch()
    with limits.PeakSampler(cache_dir, exclude=[store_pid]) as peaks:
        it = iter(batches)
        for batch in it:
            if not out.items:
                out.first_batch_s = time.perf_counter() - started
            out.items += len(batch)
        del it
        out.seconds = time.perf_counter() - started
    clock.stop(peaks)  # the sampler's own CPU is the instrument's, not the client's
    out.cpu_client, out.cpu_store = clock.client, clock.other
    out.peak_mem, out.peak_anon, out.peak_dir = peaks.peak_mem, peaks.peak_anon, peaks.peak_dir
    return out


def raw_get_epoch(served: Served, concurrency: int, n: int | None = None) -> Epoch:
    """The limit (i) as an :class:`Epoch` of ``n`` items (default: the dataset's)."""
    clock = limits.CpuClock(served.store.pid).start()
    seconds = limits.raw_get_sync(served.target, served.parts, concurrency)
    clock.stop()
    return Epoch(served.n_items if n is None else n, 0.0, seconds, clock.client, clock.other)


def cold_ceiling(items: int, raw_get: Epoch, ceiling: Epoch, cores: int) -> float:
    """The limit (iv) in items/s: fetching and loading can overlap, but on this box the
    object store, the client and the loader share the same cores."""
    cpu = (raw_get.cpu_client + raw_get.cpu_store + ceiling.cpu_client) / cores
    return items / max(raw_get.seconds, ceiling.seconds, cpu)


def streaming_loader(
    served: Served,
    cache_dir: Path,
    shuffle: bool,
    seed: int,
    batch: int,
    workers: int,
    *,
    settings: Settings | None = None,
    endpoint: str | None = None,
    **loader_kw: Any,
) -> CacheDataLoader:
    """``CacheDataLoader(StreamingDataset(url))`` over ``cache_dir`` (through ``endpoint``)."""
    ds = StreamingDataset(
        served.url,
        cache_dir=cache_dir,
        shuffle=shuffle,
        seed=seed,
        storage_options=served.options_via(endpoint),
        settings=settings,
    )
    return CacheDataLoader(ds, batch_size=batch, num_workers=workers, **loader_kw)


def cold_epoch(
    served: Served,
    cache_dir: Path,
    batch: int,
    workers: int,
    *,
    shuffle: bool = False,
    settings: Settings | None = None,
    endpoint: str | None = None,
) -> tuple[float, float, float]:
    """One epoch of a new loader over an empty ``cache_dir`` (deleted afterwards), the clock
    started before the dataset is opened: (that start on ``time.monotonic()``, the clock
    of every process and of the proxy's log; seconds to the first batch; seconds in all)."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    t0 = time.monotonic()
    loader = streaming_loader(
        served, cache_dir, shuffle, 0, batch, workers, settings=settings, endpoint=endpoint
    )
    first, items = 0.0, 0
    for b in loader:
        if not items:
            first = time.monotonic() - t0
        items += len(b)
    seconds = time.monotonic() - t0
    del loader
    shutil.rmtree(cache_dir, ignore_errors=True)
    if items != served.n_items:
        raise SystemExit(f"an epoch yielded {items} of {served.n_items} items")
    return t0, first, seconds


def quiet() -> None:
    """Silence torch's warning about read-only arrays (items are zero-copy views) here and in
    workers, and the progress bars."""
    message = "The given NumPy array is not writable"
    warnings.filterwarnings("ignore", message=message)
    os.environ["PYTHONWARNINGS"] = f"ignore:{message}"
    os.environ.setdefault("ASYNCCACHE_PROGRESS", "0")


def settings_variant(text: str, **kw: Any) -> Settings:
    """Settings from the environment with ``NAME=VALUE[,NAME=VALUE]`` on top (``ASYNCCACHE_``
    names without the prefix, e.g. ``HEAD_START=1``): validated as the variables are."""
    pairs = (item.split("=", 1) for item in text.split(",") if item)
    env = {**os.environ, **{f"ASYNCCACHE_{k.upper()}": v for k, v in pairs}}
    return Settings.from_env(env, **kw)


# -- a link like the cloud's: the fault proxy in a process of its own -------------------------
@dataclass(frozen=True)
class Link:
    """``L:C``: L ms to the first byte of every response, C MB/s per connection (0: no cap)."""

    name: str
    latency_s: float
    cap: int  # bytes/s per connection, 0: none

    @classmethod
    def parse(cls, text: str) -> Link:
        ms, _, mbs = text.partition(":")
        return cls(f"{ms} ms, {mbs or 0} MB/s/conn", float(ms) / 1e3, int(float(mbs or 0) * 1e6))


def _proxy_main(upstream: str, conn: Connection) -> None:
    from asynccache.testing.faults import FaultProxy

    with FaultProxy(upstream) as proxy:
        conn.send(proxy.url)
        while (msg := conn.recv()) is not None:
            if msg == "count":
                conn.send(len(proxy.requests))
            elif isinstance(msg, int):  # the records from this index on
                conn.send(proxy.requests[msg:])
            else:
                proxy.set_link(**msg)
                conn.send("ok")


class ProxyProcess:
    """The project's ``FaultProxy`` (no faults) in a spawned process, so that relaying
    bytes costs this process no CPU and holds no GIL of ours; its link knobs are set and
    its request log read through a pipe. Every wait on the pipe is bounded."""

    def __init__(self, upstream: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_proxy_main, args=(upstream, child), daemon=True)
        self._proc.start()
        self.url: str = self._recv(60, "start")

    def _recv(self, timeout_s: float, what: str) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the proxy process did not {what} within {timeout_s:g} s")
        return self._conn.recv()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def set_link(self, link: Link) -> None:
        """Requests that arrive from now on see ``link`` (``0:0``: loopback through the proxy)."""
        self._conn.send({"latency_s": link.latency_s, "conn_bytes_per_s": link.cap})
        assert self._recv(10, "set its link") == "ok"

    def records(self, since: int = 0) -> list[Any]:
        """The proxy's ``RequestRecord`` of every request from the ``since``-th on (arrival,
        first body byte and end on ``time.monotonic()``, one clock for every process)."""
        self._conn.send(since)
        return self._recv(60, "answer")  # type: ignore[no-any-return]

    def mark(self) -> int:
        """How many requests the proxy has seen: pass it to :meth:`records` later."""
        self._conn.send("count")
        return int(self._recv(60, "answer"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunk_gets(records: Iterable[Any]) -> list[Any]:
    """The GETs of chunk files among the proxy's records."""
    return [r for r in records if r.method == "GET" and r.path.endswith(".bin")]
