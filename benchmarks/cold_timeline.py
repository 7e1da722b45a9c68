"""A cold epoch's timeline, process by process: who waits for whom, and which core is idle.

Runs cold epochs of ``StreamingDataset`` through ``CacheDataLoader`` (the same dataset and
loader as ``streaming_epoch.py``) with a recorder installed in this process before the
DataLoader forks its workers, so every process of the epoch records:

* each chunk download: started, each part queued for a concurrency slot, sent (slot
  taken), landed (slot given back), verified, published; hints and deferred prefetches;
  when the downloader holds prefetches back because a waited download may need slots;
* each batch a worker assembles (start, end) and each wait for a chunk inside it
  (``DatasetSource.acquire``, with the chunk);
* in the main process, each batch received and how long ``next()`` waited for it;
* every 50 ms, the CPU of each thread of this process tree and of the object store
  (``/proc/<pid>/task/<tid>/stat``), so idle cores show up.

The recorder is this script's own (the library is patched here, in the benchmark only).
Each event is a line written with ``os.write`` to a per-process file: a few microseconds,
a few thousand events per GiB.

Printed: per worker, the time spent assembling, waiting for chunks (by chunk) and held back
by the DataLoader (its batches not yet asked for); for each chunk, when it was needed
against when it was published; the main process's waits, by the worker it waited for; and
a table in 100 ms steps of the CPU by role, parts in flight per worker and what each
worker's main thread was doing.

    python benchmarks/cold_timeline.py [--total-mb 512] [--chunk-mb 64] [--shuffle]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import contextvars
import functools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import limits
import streaming_epoch as se

import asynccache.cache.layout as layoutmod
import asynccache.download.downloader as dlmod
import asynccache.download.writeback as wbmod
import asynccache.read.source as sourcemod
from asynccache import Settings
from asynccache.cache.layout import TempFile
from asynccache.cache.locks import FileLock
from asynccache.cache.store import ChunkStore
from asynccache.read.readplan import ReadPlan
from asynccache.read.source import DatasetSource
from asynccache.testing import ObjectStore
from asynccache.torch.streaming import StreamingDataset

_TICK = os.sysconf("SC_CLK_TCK")


# -- the recorder (every process) -------------------------------------------------------
class Recorder:
    """Appends ``t pid tid kind fields...`` lines to ``<dir>/ev-<pid>.tsv``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd = -1
        self._pid = -1

    def retarget(self, directory: Path) -> None:
        self.directory, self._pid = directory, -1

    def emit(self, kind: str, *fields: object) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._fd = os.open(
                self.directory / f"ev-{self._pid}.tsv", os.O_WRONLY | os.O_CREAT | os.O_APPEND
            )
        head = (f"{time.monotonic():.6f}", str(self._pid), str(threading.get_native_id()), kind)
        line = "\t".join((*head, *(str(f) for f in fields)))
        os.write(self._fd, (line + "\n").encode())


def install(rec: Recorder) -> None:
    """Wrap the library's download, wait and batch steps so they report to ``rec``."""
    emit = rec.emit
    fetch_range = dlmod.fetch_range

    async def traced_fetch_range(
        storage: Any, key: str, start: int, end: int, out: Any, **kw: Any
    ) -> None:
        slot = kw.pop("slot")
        emit("part_q", key, start)

        @contextlib.asynccontextmanager
        async def traced_slot() -> Any:
            async with slot():
                emit("part_go", key, start)
                try:
                    yield
                finally:
                    emit("part_out", key, start)

        await fetch_range(storage, key, start, end, out, slot=traced_slot, **kw)

    dlmod.fetch_range = traced_fetch_range

    fetch = dlmod.Downloader._fetch

    async def traced_fetch(self: Any, spec: Any) -> str:
        _chunk.set(spec.name)  # this task's context, and the helper threads it starts
        emit("chunk_start", spec.name, int(self._wanted(spec.name)))
        try:
            path = await fetch(self, spec)
        except BaseException as exc:
            emit("chunk_end", spec.name, type(exc).__name__)
            raise
        emit("chunk_end", spec.name, "ok")
        return path

    dlmod.Downloader._fetch = traced_fetch  # type: ignore[method-assign]

    def timed(
        kind: str, fn: Callable[..., Any], label: Callable[..., object]
    ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            emit(kind + "_start", label(*a, **kw))
            try:
                return fn(*a, **kw)
            finally:
                emit(kind + "_end", label(*a, **kw))

        return wrapper

    dlmod._verify_fd = timed("verify", dlmod._verify_fd, lambda tmp, spec, *a: spec.name)
    TempFile.publish = timed("publish", TempFile.publish, lambda tmp: os.path.basename(tmp.final))  # type: ignore[method-assign]
    DatasetSource.acquire = timed("acq", DatasetSource.acquire, lambda src, ci, *a: ci)  # type: ignore[method-assign]
    adopt = ChunkStore.adopt

    def traced_adopt(store: ChunkStore, name: str, tmp: TempFile) -> bool:
        held = adopt(store, name, tmp)
        if held:  # readable here from now on, before its publish (docs/cache.md)
            emit("adopted", name)
        return held

    ChunkStore.adopt = traced_adopt  # type: ignore[method-assign]
    install_reserve(rec)
    StreamingDataset._batch = timed(  # type: ignore[method-assign]
        "batch", StreamingDataset._batch, lambda ds, keys, *a: int(keys[0])
    )

    # Calls on the I/O thread that may block it: pwrite (dirty-page throttling) and the
    # writeback request (a full device queue). Each call over 1 ms is an event.
    def blocking(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                took = time.perf_counter() - t
                if took > 0.001:
                    emit("block", kind, f"{took:.6f}")

        return wrapper

    # (The writeback request runs on a thread of its own: its blocking no longer holds
    # the I/O thread, but is still shown.)
    wbmod.start_writeback = blocking("writeback", wbmod.start_writeback)
    TempFile.pwrite = blocking("pwrite", TempFile.pwrite)  # type: ignore[method-assign]

    set_hint = dlmod.Downloader._set_hint

    def traced_hint(self: Any, specs: list[Any]) -> None:
        emit("hint", ",".join(s.name for s in specs[: self.settings.prefetch_chunks]))
        set_hint(self, specs)

    dlmod.Downloader._set_hint = traced_hint  # type: ignore[method-assign]

    needs = dlmod.Downloader._waited_needs_slots
    held: dict[int, bool] = {}

    def traced_needs(self: Any) -> bool:
        out = needs(self)
        if held.get(id(self)) != out:
            held[id(self)] = out
            emit("held_back", int(out))
        return out

    dlmod.Downloader._waited_needs_slots = traced_needs  # type: ignore[method-assign]

    defer = dlmod.Downloader._defer

    def traced_defer(self: Any) -> None:
        emit("deferred")
        defer(self)

    dlmod.Downloader._defer = traced_defer  # type: ignore[method-assign]


# The chunk a download task works on, seen by the steps it calls (a contextvar: the
# helper threads it starts get a copy of its context).
_chunk: contextvars.ContextVar[str] = contextvars.ContextVar("chunk", default="?")


def install_reserve(rec: Recorder) -> None:
    """Time each step between a download's start and its first part: the chunk's download
    lock, the in-process queue for the eviction lock, the cache-wide flock, the helper
    thread's start, the temporary file's creation and its preallocation, and, at publish,
    the fsyncs and the rename."""
    emit = rec.emit
    acquire = FileLock.acquire

    async def traced_acquire(lock: FileLock) -> None:
        await acquire(lock)
        name = os.path.basename(lock.path)
        if name.endswith(".lock"):
            emit("dlock", name[: -len(".lock")])

    FileLock.acquire = traced_acquire  # type: ignore[method-assign]
    reserve = ChunkStore.reserve

    async def traced_reserve(store: ChunkStore, name: str, size: int, **kw: Any) -> TempFile:
        emit("resv_start", name)
        try:
            return await reserve(store, name, size, **kw)
        finally:
            emit("resv_end", name)

    ChunkStore.reserve = traced_reserve  # type: ignore[method-assign]
    lock_evict = ChunkStore._lock_evict

    async def traced_lock_evict(store: ChunkStore) -> int:
        emit("evmutex", _chunk.get())  # this process's queue for the lock passed
        fd = await lock_evict(store)
        emit("evlock", _chunk.get())
        return fd

    ChunkStore._lock_evict = traced_lock_evict  # type: ignore[method-assign]
    if hasattr(ChunkStore, "reserve_ahead"):  # not in a tree before files made ahead
        reserve_ahead = ChunkStore.reserve_ahead

        async def traced_reserve_ahead(store: ChunkStore, name: str, size: int) -> bool:
            _chunk.set(name)  # this task's own context
            emit("resv_start", name)
            try:
                return await reserve_ahead(store, name, size)
            finally:
                emit("resv_end", name)

        ChunkStore.reserve_ahead = traced_reserve_ahead  # type: ignore[method-assign]
        make_ahead = dlmod.Downloader._make_ahead

        def traced_make_ahead(self: Any) -> None:
            before = set(self._reserving)
            make_ahead(self)
            emit(
                "ahead",
                ",".join(s.name for s in self._queue),
                ",".join(sorted(set(self._reserving) - before)) or "-",
                ",".join(sorted(self.store.ready_ahead())) or "-",
                ",".join(sorted(self._inflight)) or "-",
            )

        dlmod.Downloader._make_ahead = traced_make_ahead  # type: ignore[method-assign]

    def traced_decision(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        # The work done holding the eviction lock: the decision, the ledger (and, before
        # admit-then-create, the file's creation and preallocation).
        @functools.wraps(fn)
        def wrapper(store: ChunkStore, fd: int, name: str, *a: Any) -> Any:
            if kind:
                emit(kind, name)
            emit("held_start", name)
            try:
                return fn(store, fd, name, *a)
            finally:
                emit("held_end", name)

        return wrapper

    ChunkStore._reserve_locked = traced_decision("rthread", ChunkStore._reserve_locked)  # type: ignore[method-assign]
    if hasattr(ChunkStore, "_reserve_spare_locked"):
        ChunkStore._reserve_spare_locked = traced_decision(  # type: ignore[method-assign]
            "", ChunkStore._reserve_spare_locked
        )
    tempfile_init = TempFile.__init__

    def traced_init(tmp: TempFile, final: Path, *a: Any, **kw: Any) -> None:
        emit("create_start", final.name)
        try:
            tempfile_init(tmp, final, *a, **kw)
        finally:
            emit("create_end", final.name)

    TempFile.__init__ = traced_init  # type: ignore[method-assign]

    def took(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                emit("took", kind, _chunk.get(), f"{time.perf_counter() - t:.6f}")

        return wrapper

    # The system calls of a reservation and of a publish (this benchmark's processes only).
    os.posix_fallocate = took("fallocate", os.posix_fallocate)
    os.fsync = took("fsync", os.fsync)
    for attr in ("fdatasync", "ftruncate", "replace"):
        if hasattr(os, attr):
            setattr(os, attr, took(attr, getattr(os, attr)))


# -- the behaviour before, for comparisons in one run (variants "bench:old-window", "bench:old-hint")
def _old_pump(self: Any) -> None:
    """Downloader._pump as of 7fee2f4: every chunk of the window started at once."""
    if self._closed:
        return
    self._consume_noted()
    if self._waited_needs_slots() or self._deferred:
        return
    for spec in self._window():
        if spec.name in self._inflight or self.store.is_cached(spec.name, spec.size):
            continue
        self._hinted.add(spec.name)
        self._start(spec)


def _old_upcoming(self: Any, count: int) -> list[int]:
    """ReadPlan.upcoming as of 7fee2f4: a reader starting inside a run left its chunk out."""
    while self._next < len(self._chunks) and self._starts[self._next] < self.pos:
        self._next += 1
    first = [self._chunks[self._at]] if self._at is not None else []
    out = dict.fromkeys(first + [self._chunks[i] for i in self._pending])
    i = self._next
    while i < len(self._chunks) and len(out) < count:
        out[self._chunks[i]] = None
        i += 1
    return list(out)


def _no_ahead(self: Any) -> None:
    """Downloader._make_ahead as of 513bc89: no temporary file made ahead."""


def _no_dirsync(directory: Any) -> None:
    """No directory fsync (bench:no-dirsync)."""


def _truncating(publish: Callable[..., Any]) -> Callable[..., Any]:
    """TempFile.publish as of 513bc89: the file truncated to its size, always."""

    @functools.wraps(publish)
    def wrapper(tmp: TempFile) -> None:
        if tmp.fd is not None:
            os.ftruncate(tmp.fd, tmp.size)
        publish(tmp)

    return wrapper


# switch -> (class, attribute, the replacement made from the current attribute)
_OLD: dict[str, list[tuple[Any, str, Callable[[Any], Any]]]] = {
    "bench:old-window": [(dlmod.Downloader, "_pump", lambda _: _old_pump)],
    "bench:old-hint": [(ReadPlan, "upcoming", lambda _: _old_upcoming)],
    # Before the files made ahead (the reader still hints one chunk more; unused).
    "bench:no-ahead": [
        (dlmod.Downloader, "_make_ahead", lambda _: _no_ahead),
        (TempFile, "publish", _truncating),
    ],
    # What the directory fsync of each publish costs: none at all (an upper bound only: a
    # power loss may then lose a name just published, never show one over unwritten bytes).
    "bench:no-dirsync": [(layoutmod, "fsync_dir", lambda _: _no_dirsync)],
    # Temporary files made further ahead.
    "bench:ahead4": [(dlmod, "_AHEAD_FILES", lambda _: 4)],
    # ... and for chunks further past the window: the reader hints three chunks past it.
    "bench:ahead-far": [
        (dlmod, "_AHEAD_FILES", lambda _: 4),
        (sourcemod, "HINT_PAST", lambda _: 3),
    ],
}


@contextlib.contextmanager
def behaviour(switches: list[str]) -> Any:
    """The old behaviours named in ``switches`` for the duration (workers fork inside)."""
    saved = []
    for name in switches:
        for cls, attr, make in _OLD[name]:
            saved.append((cls, attr, getattr(cls, attr)))
            setattr(cls, attr, make(getattr(cls, attr)))
    try:
        yield
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)


# -- the CPU sampler (this process) -----------------------------------------------------
class CpuSampler:
    """Every ``interval_s``: CPU ticks of each thread of this process tree and of ``store_pid``."""

    def __init__(self, store_pid: int, interval_s: float = 0.05) -> None:
        self.store_pid = store_pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []  # t, pid, tid, ticks
        self.states: list[tuple[float, int, int, str]] = []  # t, pid, tid, R/S/D...
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)

    def _sample(self) -> None:
        t = time.monotonic()
        with open("/proc/stat") as f:  # the whole box: user, nice, system, idle, iowait, ...
            ticks = [int(x) for x in f.readline().split()[1:]]
        self.samples.append((t, 0, 0, sum(ticks) - ticks[3] - ticks[4]))  # busy
        self.samples.append((t, 0, 1, ticks[4]))  # iowait
        pids = [*limits.tree_pids(), self.store_pid]
        for pid in pids:
            tids = [pid] if pid == self.store_pid else _listdir(f"/proc/{pid}/task")
            for tid in tids:
                path = (
                    f"/proc/{pid}/stat" if pid == self.store_pid else f"/proc/{pid}/task/{tid}/stat"
                )
                with contextlib.suppress(OSError), open(path) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                    self.samples.append((t, pid, int(tid), int(fields[11]) + int(fields[12])))
                    self.states.append((t, pid, int(tid), fields[0]))

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)
        self.cpu_s = time.thread_time() - t0

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _listdir(path: str) -> list[int]:
    try:
        return [int(x) for x in os.listdir(path)]
    except OSError:
        return []


# -- where threads wait in the kernel (--kernel-stacks) ----------------------------------
_SYSCALL_FRAMES = ("entry_SYSCALL", "do_syscall", "x64_sys", "__x64", "__se_", "__do_sys")


class StackSampler:
    """Every ``interval_s``: the kernel stack of each thread of this process tree and of
    ``store_pid`` that is in uninterruptible sleep (state D: the disk, the page cache, a
    file-system lock), counted by (process, thread name, innermost frames). Reads
    ``/proc/<pid>/task/<tid>/stack``, which needs root on Linux; elsewhere it records
    nothing. Only D-state threads' stacks are read, so a sample costs about a millisecond."""

    def __init__(self, store_pid: int, interval_s: float = 0.02, frames: int = 8) -> None:
        self.store_pid = store_pid
        self.interval_s = interval_s
        self.frames = frames
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.samples = 0
        self.readable = os.access("/proc/self/stack", os.R_OK)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-stacks", daemon=True)

    def _sample(self) -> None:
        me = os.getpid()
        for pid in [*limits.tree_pids(), self.store_pid]:
            who = "main" if pid == me else "store" if pid == self.store_pid else "worker"
            for tid in _listdir(f"/proc/{pid}/task"):
                base = f"/proc/{pid}/task/{tid}"
                try:
                    with open(f"{base}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "D":
                            continue
                    with open(f"{base}/comm") as f:
                        comm = f.read().strip()
                    with open(f"{base}/stack") as f:
                        stack = [ln.split()[1].split("+")[0] for ln in f.read().splitlines()]
                except (OSError, IndexError):
                    continue
                stack = [fr for fr in stack if not fr.startswith(_SYSCALL_FRAMES)]
                self.counts[(who, comm, " < ".join(stack[: self.frames]))] += 1
        self.samples += 1

    def _run(self) -> None:
        while self.readable and not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def report(self, top: int = 15) -> str:
        if not self.readable:
            return "kernel stacks: not readable here (/proc/<pid>/stack needs root on Linux)"
        lines = [
            f"kernel stacks of threads in D state, sampled every {self.interval_s * 1e3:.0f} ms "
            f"({self.samples} samples; seconds = samples x interval, per thread):"
        ]
        for (who, comm, stack), n in self.counts.most_common(top):
            lines.append(f"  {n * self.interval_s:5.2f} s {who:6} {comm:15} {stack}")
        return "\n".join(lines)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- one traced cold epoch --------------------------------------------------------------
def traced_epoch(
    rec: Recorder,
    served: se.Served,
    cache: Path,
    shuffle: bool,
    batch: int,
    workers: int,
    stacks: StackSampler | None = None,
) -> tuple[
    float, float, list[tuple[float, int, int, int]], list[tuple[float, int, int, str]], float
]:
    """The epoch's start (monotonic), its seconds, the CPU samples, the thread states, the
    client CPU s."""
    clock = limits.CpuClock(served.store.pid).start()
    with CpuSampler(served.store.pid) as cpu, stacks or contextlib.nullcontext():
        t0 = time.monotonic()
        rec.emit("epoch_start")
        loader = se.streaming_loader(served, cache, shuffle, 0, batch, workers)
        it = iter(loader)
        i = 0
        while True:
            t = time.monotonic()
            try:
                b = next(it)
            except StopIteration:
                break
            rec.emit("recv", i, f"{time.monotonic() - t:.6f}", len(b))
            i += 1
            del b
        del it, loader
        seconds = time.monotonic() - t0
        rec.emit("epoch_end")
    clock.stop(cpu)  # type: ignore[arg-type]
    return t0, seconds, cpu.samples, cpu.states, clock.client


# -- the analysis -----------------------------------------------------------------------
_STEPS = (
    "dlock",
    "resv_start",
    "evmutex",
    "evlock",
    "rthread",
    "create_start",
    "create_end",
    "resv_end",
)


def load_events(directory: Path) -> list[list[str]]:
    out = []
    for p in directory.glob("ev-*.tsv"):
        out += [line.split("\t") for line in p.read_text().splitlines()]
    out.sort(key=lambda e: float(e[0]))
    return out


def analyse(
    events: list[list[str]],
    t0: float,
    seconds: float,
    samples: list[tuple[float, int, int, int]],
    states: list[tuple[float, int, int, str]],
    store_pid: int,
    step: float = 0.1,
) -> str:
    lines: list[str] = []
    say = lines.append
    main_pid = os.getpid()
    # Roles of threads, from the events they emitted.
    role: dict[tuple[int, int], str] = {}
    wpids: list[int] = []
    for e in events:
        pid, tid, kind = int(e[1]), int(e[2]), e[3]
        if pid != main_pid and pid not in wpids and kind in ("batch_start", "acq_start"):
            wpids.append(pid)
    name_of = {main_pid: "main", **{p: f"w{j}" for j, p in enumerate(wpids)}}
    for e in events:
        pid, tid, kind = int(e[1]), int(e[2]), e[3]
        who = name_of.get(pid, f"p{pid}")
        if kind in (
            "part_q",
            "part_go",
            "part_out",
            "chunk_start",
            "chunk_end",
            "hint",
            "held_back",
        ):
            role[(pid, tid)] = f"{who}.io"
        elif kind in ("batch_start", "acq_start", "recv") and (pid, tid) not in role:
            role[(pid, tid)] = f"{who}.main"
        elif kind in ("verify_start", "publish_start") and (pid, tid) not in role:
            role[(pid, tid)] = f"{who}.help"
    if main_pid in name_of:
        role[(main_pid, main_pid)] = "main.main"

    def role_of(pid: int, tid: int) -> str:
        if pid == 0:
            return "box.busy" if tid == 0 else "box.iowait"
        if pid == store_pid:
            return "store"
        if (pid, tid) in role:
            return role[(pid, tid)]
        who = name_of.get(pid)
        if who is None:
            return "other"
        return f"{who}.help" if who != "main" else "main.other"

    # CPU per role per step.
    nsteps = int(seconds / step) + 1
    cpu: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * nsteps)
    last: dict[tuple[int, int], int] = {}
    for t, pid, tid, ticks in samples:
        k = (pid, tid)
        if k in last and ticks > last[k]:
            b = int((t - t0) / step)
            if 0 <= b < nsteps:
                cpu[role_of(pid, tid)][b] += (ticks - last[k]) / _TICK
        last[k] = ticks
    box = {r: cpu.pop(r) for r in ("box.busy", "box.iowait") if r in cpu}
    totals = {r: sum(v) for r, v in cpu.items()}

    # Intervals of each worker's main thread.
    open_: dict[tuple[str, str], float] = {}
    acq: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    bat: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    parts: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    chunk: dict[str, dict[str, float]] = collections.defaultdict(dict)
    recv: list[tuple[float, int, float]] = []
    held: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    deferred = collections.Counter()
    blocked: dict[tuple[str, str], list[tuple[float, float]]] = collections.defaultdict(list)
    steps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)  # (chunk, call)
    lock_wait: list[float] = []  # this process's queue passed -> the eviction flock held
    lock_held: list[float] = []  # the decision (and what else is done holding it)
    for e in events:
        t, pid, kind, f = float(e[0]) - t0, int(e[1]), e[3], e[4:]
        who = name_of.get(pid, f"p{pid}")
        if kind == "acq_start":
            open_[(who, "acq" + f[0])] = t
        elif kind == "acq_end":
            s = open_.pop((who, "acq" + f[0]), None)
            if s is not None:
                acq[who].append((s, t, f[0]))
        elif kind == "batch_start":
            open_[(who, "batch")] = t
        elif kind == "batch_end":
            s = open_.pop((who, "batch"), None)
            if s is not None:
                bat[who].append((s, t))
        elif kind == "part_q":
            chunk[f[0]].setdefault("first_q", t)  # locked, reserved: its parts queue
        elif kind == "part_go":
            open_[(who, "part" + f[0] + f[1])] = t
            chunk[f[0]].setdefault("first_go", t)
            chunk[f[0]]["who"] = who  # type: ignore[assignment]
        elif kind == "part_out":
            s = open_.pop((who, "part" + f[0] + f[1]), None)
            if s is not None:
                parts[who].append((s, t))
            chunk[f[0]]["last_out"] = t
        elif kind == "chunk_start":
            chunk[f[0]].setdefault("start", t)
        elif kind == "verify_start":
            chunk[f[0]]["verify"] = t
        elif kind == "verify_end":
            chunk[f[0]]["verified"] = t
        elif kind == "publish_start":
            chunk[f[0]]["publish"] = t
        elif kind == "adopted":
            chunk[f[0]]["adopted"] = t
        elif kind == "publish_end":
            chunk[f[0]]["published"] = t
        elif kind in _STEPS:
            chunk[f[0]].setdefault(kind, t)
        if kind in ("evmutex", "held_start"):
            open_[(str(pid), kind + f[0])] = t
        elif kind == "evlock":
            s = open_.pop((str(pid), "evmutex" + f[0]), None)
            if s is not None:
                lock_wait.append(t - s)
        elif kind == "held_end":
            s = open_.pop((str(pid), "held_start" + f[0]), None)
            if s is not None:
                lock_held.append(t - s)
        elif kind == "took":
            steps[(f[1], f[0])].append(float(f[2]))
        elif kind == "recv":
            recv.append((t, int(f[0]), float(f[1])))
        elif kind == "held_back":
            held[who].append((t, int(f[0])))
        elif kind == "deferred":
            deferred[who] += 1
        elif kind == "block":
            blocked[(who, f[0])].append((t - float(f[1]), t))

    def busy(intervals: list[tuple[float, float]], a: float, b: float) -> float:
        return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)

    cores = limits.cores()
    allcpu = sum(totals.values())
    say(
        f"epoch {seconds:.2f} s; CPU sampled {allcpu:.2f} s of {cores * seconds:.2f} core-s "
        f"({allcpu / (cores * seconds):.0%} of {cores} cores)"
    )
    say(
        f"the whole box: busy {sum(box.get('box.busy', [0.0])):.2f} core-s, of which not "
        f"this epoch's {sum(box.get('box.busy', [0.0])) - allcpu:.2f}; iowait "
        f"{sum(box.get('box.iowait', [0.0])):.2f} core-s"
    )
    say("CPU s by role: " + ", ".join(f"{r} {v:.2f}" for r, v in sorted(totals.items())))
    # Workers.
    for w in sorted(bat):
        b_s = sum(y - x for x, y in bat[w])
        a_s = sum(y - x for x, y, _ in acq[w])
        first = bat[w][0][0] if bat[w] else 0.0
        end = bat[w][-1][1] if bat[w] else 0.0
        gaps = sum(bat[w][i + 1][0] - bat[w][i][1] for i in range(len(bat[w]) - 1))
        say(
            f"{w}: {len(bat[w])} batches from {first:.2f} to {end:.2f} s: in _batch {b_s:.2f} s "
            f"(of which waiting for chunks {a_s:.2f} s), between batches (held back by the "
            f"DataLoader or yielding) {gaps:.2f} s; parts in flight on average "
            f"{busy(parts[w], first, end) / max(end - first, 1e-9):.1f}; "
            f"deferred prefetches {deferred[w]}; prefetch held back "
            f"{sum(1 for _, v in held[w] if v)} times"
        )
        waits = [(x, y, c) for x, y, c in acq[w] if y - x > 0.005]
        say(
            "  waits > 5 ms for a chunk: "
            + ", ".join(f"{c}@{x:.2f}+{y - x:.2f}" for x, y, c in waits)
        )
    seen = collections.Counter()
    for _, pid, tid, st in states:
        if pid:
            seen[(role_of(pid, tid), st)] += 1
    per_role = collections.Counter()
    for (r, _), n in seen.items():
        per_role[r] += n
    say(
        "thread states sampled every 50 ms (R running or runnable, D in uninterruptible "
        "sleep: waiting for the disk or the page cache): "
        + ", ".join(
            f"{r} R {seen[(r, 'R')] / n:.0%} D {seen[(r, 'D')] / n:.0%}"
            for r, n in sorted(per_role.items())
            if r != "other"
        )
    )
    for (w, k), ivs in sorted(blocked.items()):
        say(
            f"{w}: the I/O thread blocked in {k} {len(ivs)} times over 1 ms, "
            f"{sum(y - x for x, y in ivs):.2f} s in all, longest {max(y - x for x, y in ivs):.3f} s"
        )
    # Chunks.
    say(
        "\nchunks (s from the epoch start): who, download start, first part queued (its "
        "download lock held, its file reserved), first part sent, last part "
        "landed, verify start-end, readable here (adopted; - if not), publish start-end, "
        "first needed by its reader, readable to that reader - needed"
    )
    need: dict[str, float] = {}
    readers: dict[str, str] = {}  # chunk -> the worker that asked for it first
    for who, ivs in acq.items():
        for x, _, c in ivs:
            if x < need.get(c, float("inf")):
                need[c], readers[c] = x, who
    for name, c in sorted(chunk.items(), key=lambda kv: kv[1].get("start", 0.0)):
        ci = str(int(name.rsplit("-", 1)[1].split(".")[0])) if name.startswith("chunk-") else name
        n = need.get(ci)
        pub = c.get("published")
        adopted = c.get("adopted")
        # The reader in the downloading worker reads it once adopted; another waits for
        # the published name.
        ready = adopted if adopted is not None and readers.get(ci) == c.get("who") else pub
        lag = f"{ready - n:+.2f}" if n is not None and ready is not None else "-"
        say(
            f"  {name} {c.get('who', '?')}: {c.get('start', float('nan')):.2f} "
            f"{c.get('first_q', float('nan')):.2f} {c.get('first_go', float('nan')):.2f} {c.get('last_out', float('nan')):.2f} "
            f"{c.get('verify', float('nan')):.2f}-{c.get('verified', float('nan')):.2f} "
            f"{f'{adopted:.2f}' if adopted is not None else '-'} "
            f"{c.get('publish', float('nan')):.2f}-"
            f"{pub if pub is not None else float('nan'):.2f} "
            f"{n if n is not None else float('nan'):.2f} {lag}"
        )
    # Reservations, step by step.
    say(
        "\nfrom each download's start to its first part (s after the download start): "
        "download lock held, reserve called, this process's queue for the eviction lock "
        "passed, eviction flock held, helper thread running, temporary file created "
        "(preallocation s), reserve returned, first part sent; then its publish: the "
        "calls' seconds"
    )
    first_go: list[float] = []
    for name, c in sorted(chunk.items(), key=lambda kv: kv[1].get("start", 0.0)):
        s0 = c.get("start")
        if s0 is None:
            continue

        def at(k: str, c: dict[str, float] = c, s0: float = s0) -> str:
            v = c.get(k)
            return f"{v - s0:+.3f}" if v is not None else "-"

        if c.get("first_go") is not None:
            first_go.append(c["first_go"] - s0)
        calls = "; ".join(
            f"{k} " + "/".join(f"{x:.3f}" for x in steps[(name, k)])
            for k in ("fallocate", "ftruncate", "fsync", "fdatasync", "replace")
            if steps.get((name, k))
        )
        say(
            f"  {name} {c.get('who', '?')}: lock {at('dlock')} resv {at('resv_start')} "
            f"queue {at('evmutex')} flock {at('evlock')} thread {at('rthread')} "
            f"create {at('create_start')}..{at('create_end')} "
            f"returned {at('resv_end')} first part {at('first_go')} | {calls}"
        )
    made = [
        n
        for n, c in chunk.items()
        if n.startswith("chunk-") and c.get("create_end", float("inf")) <= c.get("start", 0.0)
    ]
    say(
        f"  downloads that found their temporary file made ahead: {len(made)} of "
        f"{sum(1 for n, c in chunk.items() if n.startswith('chunk-') and 'start' in c)}"
    )
    say(
        f"  reservations decided with the eviction flock free at once (no wait): "
        f"{max(len(lock_held) - len(lock_wait), 0)} of {len(lock_held)}"
    )
    for what, xs in (
        ("waited for (where a reservation queued for it)", lock_wait),
        ("held for a reservation", lock_held),
    ):
        if xs:
            xs = sorted(xs)
            say(
                f"  the eviction flock {what}: {len(xs)} times, median {xs[len(xs) // 2]:.3f} s, "
                f"max {xs[-1]:.3f} s, total {sum(xs):.2f} s, over 0.05 s: "
                f"{sum(1 for x in xs if x > 0.05)}"
            )
    if first_go:
        first_go.sort()
        say(
            f"  first part after the download start: median {first_go[len(first_go) // 2]:.3f} s, "
            f"max {first_go[-1]:.3f} s, over 0.2 s: {sum(1 for x in first_go if x > 0.2)} "
            f"of {len(first_go)}"
        )
    # The main process.
    waits = [(t, i, w) for t, i, w in recv if w > 0.01]
    tot = sum(w for _, _, w in recv)
    say(
        f"\nmain: {len(recv)} batches, waited {tot:.2f} s in next() ({len(waits)} waits > 10 ms); "
        f"batch 0 at {recv[0][0]:.2f} s"
        if recv
        else "main: no batch"
    )
    by = collections.Counter()
    for _, i, w in recv:
        if i and w > 0.01:
            by[f"w{(i - 1) % max(len(wpids), 1)}"] += w
    say(
        "  waits > 10 ms by the worker whose batch was next: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(by.items()))
    )
    # The table.
    roles = sorted(totals, key=lambda r: (r != "main.main", r))
    say(
        f"\nin {step * 1000:.0f} ms steps: CPU (fraction of a core) by role; parts in flight "
        "per worker; share of the step each I/O thread was blocked in pwrite or the writeback request; each worker's main thread: A assembling, W<chunk> waiting for it, "
        ". between batches; main: R waiting in next(), b batches received"
    )
    say(
        "t     "
        + " ".join(f"{r[:9]:>9}" for r in roles)
        + "   sum others iowait | "
        + " ".join(f"{w}in" for w in sorted(bat))
        + " "
        + " ".join(f"{w}blk" for w in sorted(bat))
        + " | "
        + " ".join(f"{w:>5}" for w in sorted(bat))
        + " | main"
    )
    for s in range(nsteps):
        a, b = s * step, (s + 1) * step
        row = [f"{a:4.1f} "]
        row += [f"{cpu[r][s] / step:9.2f}" for r in roles]
        ours = sum(cpu[r][s] for r in roles) / step
        bb = box.get("box.busy", [0.0] * nsteps)[s] / step
        row.append(
            f"{ours:5.2f} {bb - ours:6.2f} {box.get('box.iowait', [0.0] * nsteps)[s] / step:6.2f} |"
        )
        row += [f"{busy(parts[w], a, b) / step:4.1f}" for w in sorted(bat)]
        row += [
            f"{busy(blocked[(w, 'pwrite')] + blocked[(w, 'writeback')], a, b) / step:4.2f}"
            for w in sorted(bat)
        ]
        row.append("|")
        for w in sorted(bat):
            in_acq = [(x, y, c) for x, y, c in acq[w] if x < b and y > a and y - x > 0.001]
            if in_acq and busy([(x, y) for x, y, _ in in_acq], a, b) > step / 2:
                row.append(f"{'W' + in_acq[0][2]:>5}")
            elif busy(bat[w], a, b) > step / 2:
                row.append(f"{'A':>5}")
            else:
                row.append(f"{'.':>5}")
        got = sum(1 for t, _, _ in recv if a <= t < b)
        waited = sum(max(0.0, min(b, t) - max(a, t - w)) for t, _, w in recv)
        row.append(f"| {'R' if waited > step / 2 else ' '} {got}b")
        say(" ".join(row))
    return "\n".join(lines)


def disk_seconds(work: Path, payload: int, chunk_bytes: int) -> float:
    """The payload written into new files of ``chunk_bytes`` (2 threads, 8 MiB pwrites,
    each file fsynced), no network: what a durable cache asks of this box's disk."""
    return limits.durable_write(work / "disk", payload, chunk_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=512)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--item-kb", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=[""],
        help="settings to compare, each NAME=VALUE[,NAME=VALUE] ('' for the defaults; "
        "bench:old-window, bench:old-hint, bench:no-ahead: the behaviour before), run in "
        "turn in every repetition",
    )
    ap.add_argument("--out", type=str, default="", help="also write the report to this file")
    ap.add_argument(
        "--traces", type=str, default="", help="keep each run's events in DIR/trace-<run>"
    )
    ap.add_argument(
        "--kernel-stacks",
        action="store_true",
        help="also sample the kernel stacks of threads waiting in D state (root, Linux)",
    )
    args = ap.parse_args()
    settings = Settings.from_env(progress=False)
    work = Path(tempfile.mkdtemp(prefix="asynccache-timeline-"))
    reports = []
    try:
        with ObjectStore(volume_size_limit_mb=1024) as store:
            served = se.serve(
                store,
                work,
                args.total_mb << 20,
                args.item_kb << 10,
                args.chunk_mb << 20,
                settings.part_bytes,
            )
            disk_s = disk_seconds(work, served.payload, args.chunk_mb << 20)
            disk = (
                f"the disk (the same bytes written into new files, fsynced, 2 threads): "
                f"{disk_s:.2f} s, {served.payload / disk_s / 1e6:,.0f} MB/s"
            )
            print(disk, flush=True)
            runs = [(rep, v) for rep in range(args.reps) for v in args.variants]
            for run, (rep, variant) in enumerate(runs):
                items = [kv for kv in variant.split(",") if kv]
                switches = [kv for kv in items if kv.startswith("bench:")]
                env = dict(kv.split("=", 1) for kv in items if not kv.startswith("bench:"))
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)  # read by the dataset's Settings.from_env
                rep = run
                trace = (Path(args.traces) if args.traces else work) / f"trace-{rep}"
                trace.mkdir(parents=True)
                if rep == 0:
                    rec = Recorder(trace)
                    install(rec)
                else:  # the patches emit through the first recorder: point it here
                    rec.retarget(trace)
                cache = work / f"cache-{rep}"
                load0 = limits.loadavg()
                stacks = StackSampler(store.pid) if args.kernel_stacks else None
                with behaviour(switches):
                    t0, seconds, samples, states, client = traced_epoch(
                        rec, served, cache, args.shuffle, args.batch, args.workers, stacks
                    )
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                text = analyse(load_events(trace), t0, seconds, samples, states, store.pid)
                head = (
                    f"cold epoch, {served.n_items} items x {args.item_kb} KiB "
                    f"({served.payload / 2**20:,.0f} MiB), chunks {args.chunk_mb} MiB, parts "
                    f"{settings.part_bytes >> 20} MiB, batch {args.batch}, workers "
                    f"{args.workers}, shuffle {args.shuffle}, prefetch_chunks "
                    f"{settings.prefetch_chunks}, max_concurrency {settings.max_concurrency}; "
                    f"run {rep} ({variant or 'defaults'}): {served.n_items / seconds:,.0f} items/s, client CPU "
                    f"{client:.2f} s; load before {load0}, after {limits.loadavg()}"
                )
                if stacks is not None:
                    text += "\n" + stacks.report()
                reports.append(head + "\n" + disk + "\n" + text)
                print(reports[-1], flush=True)
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text("\n\n".join(reports) + "\n")


if __name__ == "__main__":
    se.quiet()
    main()
