"""The chunk downloader: one GET per chunk per node, verified, published atomically."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

import xxhash

from ..bridge import LoopThread, forksafe, get_loop_thread
from ..cache.fsutil import file_identity
from ..cache.layout import TempFile
from ..cache.locks import in_thread, try_lock
from ..cache.plan import Deferred
from ..cache.store import ChunkStore
from ..config import Settings
from ..errors import (
    BridgeError,
    ChecksumMismatchError,
    DatasetRewrittenError,
    DiskFullError,
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorageError,
    StorageTimeoutError,
    ThrottleTimeoutError,
)
from ..storage.base import ObjectInfo, Storage
from ..storage.transport import gather_or_cancel
from .gate import PriorityGate, shared_gate
from .link import endpoint_of, link_for, part_bytes_for, window_bytes
from .parts import Span, fetch_range, split_parts
from .progress import ProgressClock
from .ranges import RangeCheck, read_range
from .retry import RetryBudget, RetryPolicy
from .stats import DownloadStats
from .writeback import flush as flush_writeback

__all__ = ["ChunkSpec", "Downloader", "file_checksum"]

log = logging.getLogger(__name__)

_HASH_BLOCK = 8 << 20
_WAIT_SLICE_S = 0.5  # how often a waiter looks at its download's progress
_STALL_SLACK_S = 5.0  # closing a failed response, scheduling: not a stall
_MIN_VERIFY_BYTES_PER_S = 10e6  # the slowest hash + fsync we wait for before calling it stuck
_DEFER_RETRY_S = 0.1  # a deferred prefetch is tried again this soon, or at the next read
_SPLIT_MIN_BYTES = 1 << 20  # a straggler is split only if each half keeps at least this
_SPLIT_FIRST_BYTES = 8  # ... and only if what is left takes this many first-byte waits
_AHEAD_FILES = 2  # temporary files made ahead for the window's next chunks (_make_ahead)
_WRITEBACK_FLUSH_S = 5.0  # at close, the wait for early-writeback requests still queued


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """A chunk as the index records it: file name, byte size, xxh3_64 hex checksum."""

    name: str
    size: int | None = None
    checksum: str | None = None


class Downloader:
    """Brings chunks of one dataset into the local cache, concurrently and ahead of need.

    Invariants:
        * Local storage (``storage.is_local``) is read in place: never copied, never evicted.
        * One GET per chunk per node: in-process callers share one task (single-flight);
          other processes wait on the chunk's download lock and then find it published.
        * At most ``settings.max_concurrency`` requests are open at once in this process;
          a free slot goes first to a chunk some caller is waiting for, then to prefetches,
          and no new prefetch starts while a caller waits for a download in flight that
          may still need a slot (it would share that download's bandwidth: the time to the
          first batch); once all its parts receive bytes, spare slots may prefetch.
        * A chunk becomes visible under its name only complete, size- and checksum-verified.
        * A download whose bytes don't match the index's checksum is damage (in transit,
          or where the object is stored) and is downloaded again within the retry budget
          (``ASYNCCACHE_RETRIES``); it is a rewrite of the dataset
          (:class:`DatasetRewrittenError`, not retried) only when the object's size
          differs from the index's, or its ETag changed between two downloads, as a HEAD
          after each mismatch finds them.
        * With ``early`` (:meth:`ensure`), a caller is answered once its chunk is verified,
          before the publish's fsync: the store holds the chunk for this process's pins
          (:meth:`.ChunkStore.adopt`) while the publish goes on in a worker thread; the
          download (its lock, its statistics) ends after the publish, so other processes
          still wait for the published name. Chunks fsynced at publish (see
          :mod:`asynccache.cache.stamp`) on systems with ``/proc/self/fd`` only;
          elsewhere ``early`` waits for the publish, which is then short.
        * A published chunk the store does not trust as it is (from an earlier boot) is
          checked against its checksum under its download lock before anything is
          fetched (:meth:`.ChunkStore.restamp`); only one that does not match is
          downloaded again.
        * Every wait is bounded: per-attempt stall timeout (no byte for ``timeout_s``, or
          under ``min_bytes_per_s`` over that window), retry budget, lock-wait bound. A
          sync waiter (:meth:`wait`) is bounded by progress, not by a total: it gives up
          only when its download showed no sign of life for :attr:`stall_s`.
        * A download nobody wants any more is cancelled: when its last waiter gives up
          (cancelled, timed out, interrupted) and it is not in the prefetch window.
        * All state changes happen on the I/O thread; other threads only submit work.
        * The prefetch window is the first ``settings.prefetch_chunks`` hinted chunks the
          reader has not asked for yet, extended for small chunks up to the link's window
          bytes (:meth:`window_depth`); hinted downloads that leave the window with no
          caller waiting on them are cancelled. Its chunks start in order, each once its
          parts fit in ``max_concurrency`` beside the parts still to land of the
          downloads in flight (or when none are left to land), so they land in the
          order they are read.
        * The temporary files of the next ``_AHEAD_FILES`` hinted chunks not downloading
          yet are made ahead (:meth:`.ChunkStore.reserve_ahead`, only into room the cache
          has), so a download starts without a reservation; files of chunks the hint no
          longer names are removed, their bytes taken off the ledger.
        * A prefetch the store defers (the node's prefetch room is full, see
          :mod:`asynccache.cache.plan`) fetches nothing; no new prefetch starts until the
          reader asks for a chunk or ``_DEFER_RETRY_S`` passes. A caller that asks for a
          deferred chunk fetches it at once.

    Args:
        storage: the dataset's storage; the caller owns it (and closes it).
        store: the local cache of this dataset; the caller owns it.
        settings: concurrency, part size, retries, timeouts, prefetch depth.
        loop_thread: the I/O thread to run on (default: the process's).
        verify_local: check the checksum of local files once, on first use.
    """

    def __init__(
        self,
        storage: Storage,
        store: ChunkStore,
        settings: Settings,
        *,
        loop_thread: LoopThread | None = None,
        verify_local: bool = False,
    ) -> None:
        self.storage = storage
        self.store = store
        self.settings = settings
        self.stats = DownloadStats()
        self._lt = loop_thread or get_loop_thread()
        self._policy = RetryPolicy.of(settings)
        self._gate = shared_gate(self._lt, settings.max_concurrency)  # one per process
        # Range reads of first items have slots of their own: they are bounded in bytes
        # (FIRST_READ_BYTES per reader per epoch), and behind the epoch's first prefetches
        # they would wait for a whole part to finish, which is what they are there to avoid.
        self._range_gate = PriorityGate(settings.max_concurrency)
        self._verify_local = verify_local
        self._link = link_for(endpoint_of(storage))  # measured by every part (link.py)
        self._sizes: dict[str, int] = {}  # of the chunks downloading (see _bytes_ahead)
        # name -> (device, inode, size, modification and change time) of the file a
        # checksum passed for: a file replaced under the same name is hashed again.
        self._verified: dict[str, tuple[int, ...]] = {}
        self._inflight: dict[str, asyncio.Task[str]] = {}
        self._early: dict[asyncio.Task[str], asyncio.Future[str]] = {}  # see _ready_of
        self._publishing: set[asyncio.Task[str]] = set()  # handed out, publish under way
        self._parts: dict[str, int] = {}  # parts not landed, per download in flight (_pump)
        self._runs: dict[str, _Run] = {}  # the parts of each download receiving (_split_idle)
        self._all = ProgressClock()  # moves with any download of this downloader
        self._clocks: dict[str, ProgressClock] = {}  # one per download in flight
        self.stall_s = settings.timeout_s + settings.backoff_max_s + _STALL_SLACK_S
        self._waiters: dict[str, int] = {}
        self._queue: list[ChunkSpec] = []
        self._hinted: set[str] = set()
        self._seen_cached: set[str] = set()  # see _known_published
        self._deferred = False
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
        self._fast_mu = threading.Lock()
        self._fast_hits = 0  # see note_hit
        self._hit_names: list[str] = []  # chunks note_hit saw, not yet consumed from the hint
        self._hold: asyncio.Future[None] | None = None  # see hold_prefetch
        self._reserving: dict[str, asyncio.Task[bool]] = {}  # files being made ahead
        self._floor: tuple[int, int] | None = None  # (link observations, window bytes)

    def __repr__(self) -> str:
        return (
            f"<Downloader {self.storage.url} inflight={len(self._inflight)} "
            f"queued={len(self._queue)} {self.stats}>"
        )

    # -- the sync face -------------------------------------------------------------------
    def ensure(
        self,
        name: str,
        size: int | None = None,
        checksum: str | None = None,
        *,
        early: bool = False,
        hand_over: bool = False,
    ) -> concurrent.futures.Future[str]:
        """A Future of the local path of chunk ``name``, downloading it if needed.

        ``early``: resolved as soon as the chunk is verified and this process's store
        holds it (:meth:`.ChunkStore.adopt`), which may be before it is published under
        that path: the caller must read it through :meth:`.ChunkStore.pin`.
        ``hand_over``: the caller pins it next; the chunk is pinned for it as the Future
        resolves (:meth:`.ChunkStore.hand_over`), so nothing evicts it in between.
        """
        return self._lt.submit(
            self.ensure_async(name, size, checksum, early=early, hand_over=hand_over)
        )

    def read_ranges(
        self,
        name: str,
        ranges: list[tuple[int, int]],
        checks: list[RangeCheck | None] | None = None,
    ) -> concurrent.futures.Future[list[Any]]:
        """A Future of the bytes ``[start, end)`` of chunk ``name`` for each of ``ranges``,
        as 64-byte-aligned uint8 arrays in memory: never written to the cache. The bytes
        of ``ranges[i]`` are verified by ``checks[i]`` as they arrive (see
        :func:`.ranges.read_range`); without one, not at all.

        For items a reader wants before their chunk is here: the requests have a
        concurrency limit of their own (``max_concurrency``), beside the downloads', each
        attempt bounded by ``timeout_s``, within the retry budget. Cancelling the Future
        cancels the requests.
        """
        return self._lt.submit(self._read_ranges(name, ranges, checks or [None] * len(ranges)))

    async def _read_ranges(
        self, name: str, ranges: list[tuple[int, int]], checks: list[RangeCheck | None]
    ) -> list[Any]:
        return await gather_or_cancel(
            read_range(
                self.storage,
                name,
                start,
                end,
                policy=self._policy,
                timeout_s=self.settings.timeout_s,
                slot=self._range_gate.slot,
                stats=self.stats,
                link=self._link,
                verify=check,
            )
            for (start, end), check in zip(ranges, checks, strict=True)
        )

    def idle_s(self) -> float:
        """Seconds since the liveliest download in flight showed a sign of life (or, with
        none in flight, since any did). Safe from any thread."""
        now = time.monotonic()
        clocks = list(self._clocks.values())  # a copy: the I/O thread changes the dict
        return min((c.idle_s(now) for c in clocks), default=self._all.idle_s(now))

    def wait(self, fut: concurrent.futures.Future[str], name: str) -> str:
        """The result of ``fut`` (from :meth:`ensure` of ``name``), bounded by progress.

        Waits in slices; gives up with :class:`StorageTimeoutError` only when the download
        showed no sign of life (bytes, a new attempt, a phase with its own bound) for
        :attr:`stall_s`, so a large chunk on a slow but live link is waited for. A close of
        this downloader (its dataset's) from another thread meanwhile raises
        :class:`BridgeError`. On any exit without a result (timeout,
        ``KeyboardInterrupt``) ``fut`` is cancelled, which cancels the download unless
        another caller still wants it.
        """
        start = time.monotonic()
        try:
            while True:
                try:
                    return fut.result(timeout=min(_WAIT_SLICE_S, self.stall_s))
                except concurrent.futures.TimeoutError:
                    if fut.done():  # the download's own error: TimeoutError is that class
                        raise
                except concurrent.futures.CancelledError:
                    if not self._closed:
                        raise
                    url = self.storage.object_url(name)
                    raise BridgeError(
                        f"{url}: the dataset was closed while a read waited for this chunk",
                    ) from None
                now = time.monotonic()
                clock = self._clocks.get(name, self._all)
                idle = min(now - start, clock.idle_s(now))
                if idle > self.stall_s:
                    url = self.storage.object_url(name)
                    raise StorageTimeoutError(
                        f"{url}: no progress for {idle:.0f}s (bytes so far: {clock.bytes})",
                        url=url,
                    )
        except BaseException:
            fut.cancel()
            raise

    def wait_published(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, for the publishes of the chunks this process
        was handed before them (``early``), so that what a caller read is in the cache
        when it closes. True when none is left. Not from the I/O thread (False at once)."""
        if not self._publishing or self._lt.in_loop_thread():
            return not self._publishing
        try:
            return bool(self._lt.call(self._published(timeout), timeout + _STALL_SLACK_S))
        except (RuntimeError, StorageTimeoutError, concurrent.futures.CancelledError) as exc:
            # What a closed or stopped I/O thread raises (BridgeError is a RuntimeError);
            # anything else is a bug here and goes to the caller.
            log.debug("wait_published: I/O thread gone (%r)", exc)
            return False

    async def _published(self, timeout: float) -> bool:
        tasks = list(self._publishing)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        return not self._publishing

    def in_flight(self, name: str) -> bool:
        """A download of ``name`` runs now (a snapshot; safe from any thread)."""
        return name in self._inflight

    def note_hit(self, name: str) -> None:
        """A caller found chunk ``name`` published and pinned it without :meth:`ensure`:
        count the hit (in :meth:`snapshot`) and move the hint past it, as ``ensure``
        would. Never blocks."""
        with self._fast_mu:
            self._fast_hits += 1
            # Applied by the I/O thread when it next looks at the hint: waking it now
            # would cost a thread switch per chunk for nothing to fetch.
            self._hit_names.append(name)

    def snapshot(self) -> DownloadStats:
        """A copy of :attr:`stats`, with the hits counted outside the I/O thread."""
        snap = self.stats.snapshot()
        snap.hits += self._fast_hits
        return snap

    def hint(self, chunks: Iterable[ChunkSpec | str]) -> None:
        """Say which chunks come next, in order; replaces the previous hint. Never blocks."""
        specs = [c if isinstance(c, ChunkSpec) else ChunkSpec(c) for c in chunks]
        self._lt.call_soon(self._set_hint, specs)

    def hold_prefetch(self, seconds: float) -> None:
        """Until :meth:`release_prefetch`, at most ``seconds``: prefetches started from
        the hint take their locks and reservations, but none of their parts takes a
        connection (a chunk some caller waits for is not held). For the range reads of
        an epoch's first batches, which share this process's connections: the downloads
        are ready to go the moment those are in. Never blocks."""
        self._lt.call_soon(self._set_hold, seconds)

    def release_prefetch(self) -> None:
        """End :meth:`hold_prefetch`: the held parts go out. Never blocks."""
        self._lt.call_soon(self._end_hold)

    def _set_hold(self, seconds: float) -> None:
        if self._closed or (self._hold is not None and not self._hold.done()):
            return
        loop = asyncio.get_running_loop()
        self._hold = loop.create_future()
        loop.call_later(seconds, self._end_hold)  # the bound

    def _end_hold(self) -> None:
        if self._hold is not None and not self._hold.done():
            self._hold.set_result(None)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel downloads in flight and forget the hint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._lt.call(self.cancel_all(), timeout)
        except Exception:  # a closed I/O thread has nothing left to cancel
            log.debug("downloader close: I/O thread already gone")

    async def aclose(self) -> None:
        """Cancel downloads in flight and forget the hint, on the I/O thread. Idempotent."""
        self._closed = True
        await self.cancel_all()

    # -- the async core ------------------------------------------------------------------
    async def ensure_async(
        self,
        name: str,
        size: int | None = None,
        checksum: str | None = None,
        *,
        early: bool = False,
        hand_over: bool = False,
    ) -> str:
        """The local path of chunk ``name``, downloading it if needed (async twin; see
        :meth:`ensure` for ``early`` and ``hand_over``)."""
        self._consume_noted()
        self._consume_hint(name)
        if self.storage.is_local:
            return await self._local(ChunkSpec(name, size, checksum))
        path = await self._ensure_cached(name, size, checksum, early)
        if hand_over:
            # On this thread, before the caller's thread wakes: a miss here (evicted
            # already) leaves the caller's pin to miss, and it fetches again.
            self.store.hand_over(name)
        return path

    async def _ensure_cached(
        self, name: str, size: int | None, checksum: str | None, early: bool
    ) -> str:
        if name not in self._inflight and self.store.is_cached(name, size):
            self.stats.hits += 1
            self._pump()
            return str(self.store.path(name))
        self._seen_cached.discard(name)  # (evicted since the prefetch saw it)
        if early and name in self._inflight and self.store.held(name):
            self.stats.hits += 1  # downloaded and verified here, its publish under way
            self._pump()
            return str(self.store.path(name))
        self.stats.misses += 1
        self._waiters[name] = self._waiters.get(name, 0) + 1
        t0 = time.monotonic()
        task = self._start(ChunkSpec(name, size, checksum))
        try:
            while True:
                try:
                    return await asyncio.shield(self._ready_of(task) if early else task)
                except Deferred:
                    # A prefetch of it was deferred just before this caller came.
                    task = self._start(ChunkSpec(name, size, checksum))
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if self._closed or not task.cancelled() or (me is not None and me.cancelling()):
                        raise
                    # The download was cancelled (a dropped prefetch), not this caller.
                    task = self._start(ChunkSpec(name, size, checksum))
        except asyncio.CancelledError:
            # The caller gave up: the download goes on only if someone else wants it.
            if self._waiters[name] == 1 and not task.done() and not self._in_window(name):
                task.cancel()
            raise
        finally:
            self.stats.wait_s += time.monotonic() - t0
            self._waiters[name] -= 1
            if not self._waiters[name]:
                del self._waiters[name]

    def _ready_of(self, task: asyncio.Task[str]) -> asyncio.Future[str]:
        """A future of ``task``'s chunk path, resolved once the chunk is adopted (see
        :meth:`_fetch`) or else with the task's outcome."""
        ready = self._early.get(task)
        if ready is None:
            ready = self._early[task] = task.get_loop().create_future()
            task.add_done_callback(functools.partial(self._settle_ready, ready))
        return ready

    def _settle_ready(self, ready: asyncio.Future[str], task: asyncio.Task[str]) -> None:
        self._early.pop(task, None)
        if ready.done():
            return
        if task.cancelled():
            ready.cancel()
        elif (exc := task.exception()) is not None:
            ready.set_exception(exc)
            ready.exception()  # retrieved: nobody may be waiting for it any more
        else:
            ready.set_result(task.result())

    async def _local(self, spec: ChunkSpec) -> str:
        path = self.storage.local_path(spec.name)
        try:
            st = None if path is None else os.stat(path)  # one stat, cheap
        except OSError:
            st = None
        if path is None or st is None or not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(
                f"{self.storage.object_url(spec.name)} does not exist",
                url=self.storage.object_url(spec.name),
            )
        self.stats.hits += 1
        if self._verify_local and spec.checksum:
            known = self._verified.get(spec.name)
            if known != file_identity(st):
                url = self.storage.object_url(spec.name)
                self._verified[spec.name] = await asyncio.to_thread(_verify_path, path, spec, url)
        return path

    def _wanted(self, name: str) -> bool:
        """A caller is waiting for ``name`` now (not just a prefetch): it goes first."""
        return self._waiters.get(name, 0) > 0

    def _in_window(self, name: str) -> bool:
        return any(s.name == name for s in self._window())

    @contextlib.asynccontextmanager
    async def _slot(self, name: str, clock: ProgressClock) -> AsyncIterator[None]:
        """A concurrency slot for a request of ``name``; queueing for it is not a stall
        as long as the downloader moves (a slot frees when another request ends)."""
        clock.queued += 1
        queued = True
        try:
            hold = self._hold
            if hold is not None and not hold.done() and not self._wanted(name):
                await asyncio.shield(hold)  # see hold_prefetch (bounded there)
            async with self._gate.slot(functools.partial(self._wanted, name)):
                clock.queued -= 1
                queued = False
                clock.held += 1
                if not clock.queued:
                    # A download holds all the slots it asked for: the window's next
                    # chunk may start (see _pump), and if a caller waits for this one,
                    # spare slots may prefetch (see _waited_needs_slots).
                    asyncio.get_running_loop().call_soon(self._pump)
                try:
                    yield
                finally:
                    clock.held -= 1
        finally:
            if queued:
                clock.queued -= 1

    def _start(self, spec: ChunkSpec) -> asyncio.Task[str]:
        task = self._inflight.get(spec.name)
        # A task asked to cancel (a prefetch the hint dropped) ends in CancelledError,
        # which its new caller must not get: it gets a download of its own.
        if task is None or task.done() or task.cancelling():
            self._clocks[spec.name] = ProgressClock(self._all)
            task = asyncio.get_running_loop().create_task(
                self._fetch(spec), name=f"asynccache-fetch:{spec.name}"
            )
            self._inflight[spec.name] = task
            self._parts[spec.name] = self._part_count(spec.size, spec.name)  # _fill: exactly
            task.add_done_callback(functools.partial(self._done, spec.name))
        return task

    def _done(self, name: str, task: asyncio.Task[str]) -> None:
        if self._inflight.get(name) is task:
            del self._inflight[name]
            self._clocks.pop(name, None)
            self._parts.pop(name, None)
            self._sizes.pop(name, None)
        self._hinted.discard(name)
        if not task.cancelled() and isinstance(task.exception(), Deferred):
            self.stats.deferred += 1
            self._defer()
        elif not task.cancelled() and task.exception() is not None:
            log.debug("download of %s failed: %r", name, task.exception())
        log.debug("%r", self)
        self._pump()
        self._make_ahead()

    async def _fetch(self, spec: ChunkSpec) -> str:
        """Download one chunk under its cross-process lock; the path once published."""
        self.stats.started()
        clock = self._clocks.get(spec.name) or ProgressClock(self._all)
        try:
            size = spec.size
            known: ObjectInfo | None = None
            if size is None:
                known = await self.storage.head(spec.name)
                size = known.size
            fetched = False  # counted once its callers could read it
            clock.quiet(self.store.lock_timeout_s)  # another process may be downloading it
            async with self.store.download_lock(spec.name):
                clock.resume()
                if self.store.is_cached(spec.name, size):
                    return str(self.store.path(spec.name))  # another process published it
                if await self._restamped(spec, size):
                    return str(self.store.path(spec.name))  # here from an earlier boot
                spent = self._policy.budget()  # checksum mismatches: faults
                seen = known  # the object as last found (size, ETag), for telling rewrites
                first, refilled = True, False
                while True:
                    clock.quiet(self.store.lock_timeout_s)  # may wait for another evictor
                    tmp = await self._take_ahead(spec.name, size) if first else None
                    first = False
                    if tmp is None:
                        try:
                            tmp = await self.store.reserve(
                                spec.name, size, ahead=not self._wanted(spec.name)
                            )
                        except Deferred:
                            if not self._wanted(spec.name):
                                raise
                            tmp = await self.store.reserve(spec.name, size)  # a caller came
                    clock.resume()
                    self._make_ahead()  # the next chunks' files, while this one downloads
                    try:
                        try:
                            hashed = await self._fill(spec.name, size, tmp, spec.checksum)
                        except RetriesExhaustedError as exc:
                            if not isinstance(exc, ThrottleTimeoutError):
                                # Short bodies to the end: the object may have shrunk.
                                await self._changed(spec.name, size, seen, exc)
                            raise
                        url = self.storage.object_url(spec.name)
                        clock.quiet(self.settings.timeout_s + size / _MIN_VERIFY_BYTES_PER_S)
                        me = asyncio.current_task()
                        served: list[str] = []  # the loop's part of an adoption, once done
                        loop = asyncio.get_running_loop()
                        try:
                            await in_thread(
                                _verify_and_publish,
                                tmp,
                                spec,
                                url,
                                hashed,
                                self.store,
                                functools.partial(
                                    loop.call_soon_threadsafe, self._adopted, spec.name, me, served
                                ),
                            )
                        finally:
                            fetched = fetched or bool(served)
                            served.append("")  # over: an adoption reported later is moot
                            if me is not None:
                                self._publishing.discard(me)
                        clock.resume()
                        break
                    except DatasetRewrittenError:
                        tmp.discard()
                        raise
                    except ChecksumMismatchError as exc:
                        clock.quiet(self.settings.timeout_s)  # the HEAD below is bounded so
                        try:
                            now = await self._changed(spec.name, size, seen, exc)
                            if now is not None:
                                await self._stored_as_received(spec.name, tmp, size, now, exc)
                        finally:
                            tmp.discard()
                        seen = now or seen
                        delay = spent.next_delay(False)
                        if delay is None:
                            url = self.storage.object_url(spec.name)
                            raise _damaged(url, spent, seen, exc) from exc
                        self.stats.retries += 1  # bits can flip in transit: once more
                        clock.quiet(delay)
                        await asyncio.sleep(delay)
                    except DiskFullError:
                        # The disk filled during the download (preallocation does not
                        # reserve blocks everywhere): evict, then try once more.
                        tmp.discard()
                        if refilled:
                            raise
                        refilled = True
                        await self.store.make_room(size)
                    except BaseException:
                        tmp.discard()
                        raise
            if not fetched:
                self.stats.chunks_fetched += 1
            return str(self.store.path(spec.name))
        finally:
            self.stats.finished()

    async def _changed(
        self, name: str, size: int, seen: ObjectInfo | None, cause: BaseException
    ) -> ObjectInfo | None:
        """After a failed download of ``name``: the object as a HEAD finds it now, or None
        when the HEAD fails (bounded by ``timeout_s``; unknown is not a rewrite).

        Raises:
            DatasetRewrittenError: the object is gone, its size is not ``size`` (the
                index's), or its ETag is not the one ``seen`` had; names the chunk.
        """
        url = self.storage.object_url(name)
        try:
            info = await asyncio.wait_for(self.storage.head(name), self.settings.timeout_s)
        except ObjectNotFoundError as exc:
            raise DatasetRewrittenError(f"{url}: {_REWRITTEN}: the object is gone") from exc
        except (StorageError, TimeoutError):
            return None
        if info.size != size:
            raise DatasetRewrittenError(
                f"{url}: {_REWRITTEN}: the object is now {info.size} bytes, the index says {size}"
            ) from cause
        if seen is not None and seen.etag and info.etag and seen.etag != info.etag:
            raise DatasetRewrittenError(
                f"{url}: {_REWRITTEN}: its ETag went from {seen.etag} to {info.etag} between "
                "two downloads"
            ) from cause
        return info

    async def _stored_as_received(
        self, name: str, tmp: TempFile, size: int, info: ObjectInfo, cause: BaseException
    ) -> None:
        """Where the object's ETag is the MD5 of its bytes (S3 and compatible stores,
        objects not uploaded in parts), tell a rewrite from damage on the way at once: the
        bytes received in ``tmp`` hashing to that ETag are the stored ones, and they are
        not what the index describes (fetching them again can't help).

        Raises:
            DatasetRewrittenError: they are (names the chunk and the ETag).
        """
        etag = (info.etag or "").strip('"').lower()
        if len(etag) != 32 or any(c not in "0123456789abcdef" for c in etag) or tmp.fd is None:
            return
        if await in_thread(_md5_of, tmp.fd, size) == etag:
            raise DatasetRewrittenError(
                f"{self.storage.object_url(name)}: {_REWRITTEN}: the bytes stored there, "
                f"received intact (their MD5 is its ETag {info.etag}), are not the ones the "
                "index describes"
            ) from cause

    async def _restamped(self, spec: ChunkSpec, size: int) -> bool:
        """A published copy of ``spec`` not trusted as it is (stamped in an earlier boot,
        or never: see :mod:`asynccache.cache.stamp`) matched its checksum and may be
        served; False to download it (nothing to check, or it did not match)."""
        if self.store.stamp is None or not spec.checksum:
            return False
        if not os.path.exists(self.store.path(spec.name)):  # noqa: ASYNC240 - one stat
            return False
        ok = await in_thread(
            self.store.restamp, spec.name, size, functools.partial(_matches, spec.checksum)
        )
        if ok:
            self.stats.restamped += 1
        return ok

    def _adopted(self, name: str, me: asyncio.Task[str] | None, served: list[str]) -> None:
        """On the loop, once the store adopted ``name`` verified (see
        :func:`_verify_and_publish`): this process's callers read it now, while its fsync
        goes on; :meth:`wait_published` waits for that fsync. Nothing once the hand-off
        is over for the caller (``""`` in ``served``: it was cancelled and stopped waiting
        for the thread)."""
        if "" in served:
            return
        served.append(name)
        self.stats.chunks_fetched += 1  # served, published or not
        ready = self._ready_of(me) if me is not None else None
        if ready is not None and not ready.done():
            ready.set_result(str(self.store.path(name)))
        if me is not None:
            self._publishing.add(me)

    async def _take_ahead(self, name: str, size: int) -> TempFile | None:
        """The temporary file made ahead for ``name``, waiting for one being made."""
        making = self._reserving.get(name)
        if making is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(making)
        return await self.store.take_ahead(name, size)

    def _make_ahead(self) -> None:
        """Have the temporary files of the next ``_AHEAD_FILES`` hinted chunks that are not
        downloading yet made now (:meth:`.ChunkStore.reserve_ahead`), so that their
        downloads start without waiting for a reservation: on ext4 creating and
        preallocating a file waits for the journal commit in flight, which a durable
        cache's fsyncs keep busy. The hint may name chunks past the prefetch window (a
        reader hints one more): their files are made, their bytes not fetched. Files
        made for chunks the hint no longer names are removed and their bytes taken off
        the ledger."""
        if self._closed or self.storage.is_local:
            return
        nxt: list[ChunkSpec] = []
        for s in self._queue:  # the window, and the hint past it
            if len(nxt) == _AHEAD_FILES:
                break
            if s.size and s.name not in self._inflight and not self._known_published(s):
                nxt.append(s)
        keep = {s.name for s in nxt} | set(self._inflight) | set(self._reserving)
        loop = asyncio.get_running_loop()
        if not self.store.ready_ahead() <= keep:
            released = loop.create_task(self.store.release_ahead(frozenset(keep)))
            released.add_done_callback(_quiet)
        ready = self.store.ready_ahead()
        for s in nxt:
            if s.name in ready or s.name in self._reserving:
                continue
            assert s.size is not None
            task = loop.create_task(
                self.store.reserve_ahead(s.name, s.size), name=f"asynccache-ahead:{s.name}"
            )
            self._reserving[s.name] = task
            task.add_done_callback(functools.partial(self._made_ahead, s.name))

    def _made_ahead(self, name: str, task: asyncio.Task[bool]) -> None:
        if self._reserving.get(name) is task:
            del self._reserving[name]
        _quiet(task)

    async def _fill(
        self, key: str, size: int, tmp: TempFile, checksum: str | None
    ) -> _Hashed | None:
        """Fetch every part into ``tmp``; the hash of the bytes hashed on the fly.

        The first part arrives in order, so it is hashed as it streams in (a single-part
        chunk entirely); later parts arrive out of order, so the rest of a multi-part
        chunk is hashed from the file afterwards (see :func:`_verify_fd`).
        """
        part = part_bytes_for(self.settings, self._link, self._bytes_ahead(key, size), size)
        spans = [Span(start, end) for start, end in split_parts(size, part)]
        if key in self._parts:
            self._parts[key] = len(spans)
        hasher = xxhash.xxh3_64() if checksum else None
        clock = self._clocks.get(key) or ProgressClock(self._all)
        loop = asyncio.get_running_loop()
        run = _Run(spans, set(), loop.create_future())

        def launch(span: Span) -> None:
            task = loop.create_task(
                fetch_range(
                    self.storage,
                    key,
                    span.start,
                    span.end,
                    tmp,
                    policy=self._policy,
                    timeout_s=self.settings.timeout_s,
                    slot=functools.partial(self._slot, key, clock),
                    stats=self.stats,
                    hasher=hasher if span.start == 0 else None,
                    min_bytes_per_s=self.settings.min_bytes_per_s,
                    progress=clock,
                    link=self._link,
                    span=span,
                )
            )
            task.add_done_callback(functools.partial(self._landed, key))
            run.tasks.add(task)
            if not run.wake.done():
                run.wake.set_result(None)

        run.launch = launch
        for span in spans:
            launch(span)
        self._runs[key] = run
        try:
            while run.tasks:
                run.wake = loop.create_future()
                done, _ = await asyncio.wait(
                    [*run.tasks, run.wake], return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task is not run.wake:
                        run.tasks.discard(task)
                        task.result()  # a part that failed (retries spent) fails the chunk
        except BaseException:
            for task in run.tasks:
                task.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)
            raise
        finally:
            if self._runs.get(key) is run:
                del self._runs[key]
        if key in self._parts:
            # Landed: its verify and publish (the fsync) overlap the next downloads.
            self._parts[key] = 0
            self._pump()
        return _Hashed(hasher, spans[0].end) if hasher is not None else None

    def _landed(self, key: str, task: asyncio.Task[None]) -> None:
        """One part of ``key`` ended: a part landed frees a slot for the window's next
        chunk (:meth:`_pump`) or, with none to start, for a straggler's back half."""
        if task.cancelled() or task.exception() is not None:
            return
        if self._parts.get(key, 0) > 0:
            self._parts[key] -= 1
        self._pump()
        self._split_idle()

    def _split_idle(self) -> None:
        """Give each connection that would idle the back half of what is left of the
        part with most left to fetch (a straggler), as a ranged GET of its own.

        Only when no chunk of the window waits to start, the process's gate has a free
        slot nobody queues for, the link is known (a first-byte wait and a rate), and
        what is left takes at least ``_SPLIT_FIRST_BYTES`` first-byte waits with at least
        ``_SPLIT_MIN_BYTES`` in each half: the new request's first byte must come well
        before the old one would have got there, even on a new connection (a handshake
        of 2-3 round trips: the cut request's is closed). The old request stops at the split
        point (:meth:`.Span.cut`); each byte is still written once, and the chunk is
        verified whole as before.
        """
        if self._closed or not self._runs:
            return
        ttfb, rate = self._link.ttfb_s, self._link.bytes_per_s
        if ttfb is None or rate is None:
            return
        busy = sum(self._parts.get(name, 1) for name in self._inflight)
        free = min(self._gate.free, self.settings.max_concurrency - busy)
        if self._gate.waiting or self._unstarted() or self._short_of_slots():
            return
        least = max(2 * _SPLIT_MIN_BYTES, int(_SPLIT_FIRST_BYTES * ttfb * rate))
        while free > 0:
            best: tuple[int, str, Span] | None = None
            for key, run in self._runs.items():
                for span in run.spans:
                    if span.active and span.left >= least and (best is None or span.left > best[0]):
                        best = (span.left, key, span)
            if best is None:
                return
            _, key, span = best
            start, end = span.cut(span.cursor + span.left // 2)
            rest = Span(start, end)
            run = self._runs[key]
            run.spans.append(rest)
            self._parts[key] = self._parts.get(key, 0) + 1
            self.stats.splits += 1
            run.launch(rest)
            free -= 1

    # -- prefetch ------------------------------------------------------------------------
    def _set_hint(self, specs: list[ChunkSpec]) -> None:
        if self._closed or self.storage.is_local:
            return
        with self._fast_mu:
            self._hit_names = []  # a new hint starts after them
        self._queue = specs
        keep = {s.name for s in specs}
        self._seen_cached &= keep
        # A prefetch in flight goes on while the new hint still names it, even past the
        # window (a batch's chunks are asked for together, not one by one): cancelling it
        # would throw away what it received and fetch it again moments later.
        for name in list(self._hinted):
            task = self._inflight.get(name)
            if name not in keep and not self._waiters.get(name) and task is not None:
                task.cancel()
                self._hinted.discard(name)
        self._pump()

    def window_depth(self, chunk_bytes: float) -> int:
        """How many chunks of about ``chunk_bytes`` bytes the prefetch window holds: at
        least ``PREFETCH_CHUNKS``, and for small chunks as many as hold the link's window
        bytes (:func:`.link.window_bytes`), at most ``2 x MAX_CONCURRENCY``. A hint should
        name at least this many chunks (see :meth:`hint`). Safe from any thread."""
        least = max(self.settings.prefetch_chunks, 1)
        floor = self._window_floor()
        if chunk_bytes <= 0 or floor <= 0:
            return least
        most = 2 * self.settings.max_concurrency
        return max(least, min(most, -(-int(floor) // int(chunk_bytes))))

    def _window_floor(self) -> int:
        """:func:`.link.window_bytes` now: recomputed only when the link estimate moved."""
        seen = self._link.observed
        if self._floor is None or self._floor[0] != seen:
            budget = self.store.max_cache_bytes
            self._floor = (seen, window_bytes(self.settings, self._link, budget))
        return self._floor[1]

    def _window(self) -> list[ChunkSpec]:
        """The hinted chunks to have downloading: the first ``PREFETCH_CHUNKS``, then more
        while they hold fewer bytes than :meth:`_window_floor` (small chunks: a window of
        four 8 MiB chunks was half a second of a 16 x 4 MB/s link, and any pause of the
        reader emptied the link), at most ``2 x MAX_CONCURRENCY`` chunks. A chunk of
        unknown size ends the extension."""
        n = self.settings.prefetch_chunks
        if n <= 0 or len(self._queue) <= n:
            return self._queue[: max(n, 0)]
        floor = self._window_floor()
        if floor <= 0:
            return self._queue[:n]
        got = 0
        for s in self._queue[:n]:
            if not s.size:
                return self._queue[:n]
            got += s.size
        most = min(2 * self.settings.max_concurrency, len(self._queue))
        while n < most and got < floor:
            size = self._queue[n].size
            if not size:
                break
            got += size
            n += 1
        return self._queue[:n]

    def _known_published(self, spec: ChunkSpec) -> bool:
        """Whether the hinted chunk ``spec`` is published, as the prefetch decisions see
        it: once found published it is taken to stay so while the hint names it. They
        ask about every chunk of the window at every landing and every read, and a look
        at the file is a ``stat`` and a stamp read on this thread (docs/performance.md,
        "Setups off the matrix"). An eviction meanwhile costs only a prefetch: the
        reader's own ask looks at the file (``_ensure_cached``) and fetches it."""
        if spec.name in self._seen_cached:
            return True
        if self.store.is_cached(spec.name, spec.size):
            self._seen_cached.add(spec.name)
            return True
        return False

    def _unstarted(self) -> bool:
        """A chunk of the prefetch window is neither downloading nor cached."""
        return any(
            s.name not in self._inflight and not self._known_published(s) for s in self._window()
        )

    def _bytes_ahead(self, name: str, size: int) -> int:
        """Bytes of chunk ``name`` (``size``), of the other chunks downloading now, and of
        those of the prefetch window not started and not cached yet: what the part size
        must fill the connections with (see link.py)."""
        self._sizes[name] = size  # forgotten in _done
        return self._ahead(name, size)

    def _ahead(self, name: str, size: int) -> int:
        ahead = size + sum(self._sizes.get(n, size) for n in self._inflight if n != name)
        # The first PREFETCH_CHUNKS only, not the window's extension for small chunks
        # (_window): counted, 16 chunks of 8 MiB made one 8 MiB GET each, every chunk
        # then took a whole part's time on one slow connection and the reader waited
        # for each in turn; in 2 MiB parts each lands in a quarter of that.
        for s in self._queue[: self.settings.prefetch_chunks]:
            if s.name != name and s.name not in self._inflight and not self._known_published(s):
                ahead += s.size or size
        return ahead

    def _defer(self) -> None:
        """Start no prefetch until the reader asks for a chunk or the retry time passes."""
        self._deferred = True
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(_DEFER_RETRY_S, self._undefer)

    def _undefer(self) -> None:
        self._retry = None
        if self._deferred:
            self._deferred = False
            self._pump()

    def _consume_noted(self) -> None:
        if self._hit_names:
            with self._fast_mu:
                names, self._hit_names = self._hit_names, []
            for name in names:
                self._consume_hint(name)

    def _consume_hint(self, name: str) -> None:
        self._deferred = False
        for i, spec in enumerate(self._queue):
            if spec.name == name:
                for gone in self._queue[: i + 1]:
                    self._seen_cached.discard(gone.name)
                del self._queue[: i + 1]
                return

    def _pump(self) -> None:
        if self._closed:
            return
        self._consume_noted()
        if self._waited_needs_slots():
            return  # a reader waits for a download: new prefetches would slow it down
        if self._deferred:
            return  # the node's prefetch room is full (see _defer)
        # The window in parts, not only chunks: a prefetch starts when its parts fit in
        # the concurrency limit beside the parts not landed of the downloads in flight
        # (each part counts until it lands, not until its whole chunk does). Started all
        # at once, the window's chunks queued their parts behind each other and every
        # slot a part freed went to a later chunk, whose parts then shared the link with
        # the earlier chunk's last ones: the chunks landed together, late (a cold epoch
        # ran in waves; docs/performance.md, "Where a cold epoch's time went"). Started ahead
        # of room for its parts, a chunk holds its lock while they wait, and another
        # process reading it waits too: a chunk one worker needs a few items of came
        # after that worker's own chunks, and the worker it belonged to waited for it.
        # Whole chunks fit only if their part counts tile the connections: the part size
        # is chosen so that they do (link.tile_part_bytes).
        busy = sum(self._parts.get(name, 1) for name in self._inflight)
        for spec in self._window():
            if spec.name in self._inflight or self._known_published(spec):
                continue
            need = self._part_count(spec.size, spec.name)
            if busy and busy + need > self.settings.max_concurrency:
                break  # the later ones wait too: chunks land in the order they are read
            self._hinted.add(spec.name)
            self._start(spec)
            if self._parts.get(spec.name, 0) > 1 and self._elsewhere(spec.name):
                # Another process downloads it (the main process's head start, or a
                # worker sharing the chunk): it takes none of this process's
                # connections. One, not none: the window must not run further ahead of
                # what is landing here (the node keeps to its connections), but a small
                # last chunk starts now, not after a part of the one before lands.
                self._parts[spec.name] = 1
            busy += self._parts.get(spec.name, need)

    def _elsewhere(self, name: str) -> bool:
        """Another process holds the download lock of ``name`` now (a snapshot: a
        non-blocking probe, before this process's own download of it takes the lock)."""
        try:
            fd = forksafe.open_fd(self.store.lock_path(name), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False  # no lock file: nobody has downloaded it yet
        try:
            return not try_lock(fd, True)  # taken, it is released by the close
        except OSError:
            return False
        finally:
            forksafe.close_fd(fd)

    def _short_of_slots(self) -> bool:
        """A download in flight has parts that hold no slot yet: it has not got to its
        parts (lock, reservation), or some queue for a slot."""
        for name in self._inflight:
            if self._parts.get(name) == 0:
                continue  # landed: verifying, publishing
            clock = self._clocks.get(name)
            if name not in self._runs or clock is None or clock.queued:
                return True
        return False

    def _part_count(self, size: int | None, name: str = "") -> int:
        """The parts a chunk of ``size`` bytes is fetched in, as far as known before its
        download starts: the part size as adapted to the link now (it may move again
        before the download gets to its parts)."""
        if not size:
            return 1
        part = part_bytes_for(self.settings, self._link, self._ahead(name, size), size)
        return len(split_parts(size, part))

    def _waited_needs_slots(self) -> bool:
        """True while a download some caller waits for may still need a concurrency slot.

        Once every such download holds slots with none of its parts queueing for one,
        the free slots are ones it cannot use: on a link whose connections are each
        slow (the cloud), prefetches may fill them without taking its bandwidth. Nor
        does one whose parts have all landed (it is being verified and published: the
        fsync can take as long as the download on a busy disk, and the link would idle).
        """
        for name in self._inflight:
            if self._waiters.get(name) and self._parts.get(name) != 0:  # 0: all landed
                clock = self._clocks.get(name)
                if clock is None or clock.queued or not clock.held:
                    return True
        return False

    async def cancel_all(self) -> None:
        """Cancel every download in flight and forget the hint (on the I/O thread)."""
        self._queue = []
        self._seen_cached.clear()
        tasks = list(self._inflight.values()) + list(self._reserving.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        with contextlib.suppress(Exception):
            await self.store.release_ahead(frozenset())  # nothing will take them now
        if not flush_writeback(0):
            # Early-writeback requests still queued hold duplicates of their files'
            # descriptors until the writeback thread gets to them: wait for it (bounded).
            await asyncio.to_thread(flush_writeback, _WRITEBACK_FLUSH_S)

    # -- running from sync code ----------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` on this downloader's I/O thread and wait (bounded)."""
        return self._lt.call(coro, timeout)


def _quiet(task: asyncio.Task[Any]) -> None:
    """Retrieve a background task's outcome: what it did is best effort."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("%s failed: %r", task.get_name(), task.exception())


def file_checksum(fd: int, size: int) -> str:
    """xxh3_64 hex digest of the first ``size`` bytes of ``fd``."""
    h = xxhash.xxh3_64()
    offset = 0
    while offset < size:
        block = os.pread(fd, min(_HASH_BLOCK, size - offset), offset)
        if not block:
            break
        h.update(block)
        offset += len(block)
    return h.hexdigest()


@dataclasses.dataclass
class _Run:
    """The parts of one chunk being fetched: their spans (a split appends one), the
    tasks fetching them, the future that wakes the waiter when one is added, and how to
    start one (set by :meth:`Downloader._fill`)."""

    spans: list[Span]
    tasks: set[asyncio.Task[None]]
    wake: asyncio.Future[None]
    launch: Any = None


@dataclasses.dataclass
class _Hashed:
    """A running xxh3_64 of a chunk's bytes ``[0, upto)``."""

    hasher: xxhash.xxh3_64
    upto: int

    def finish(self, fd: int, size: int) -> str:
        """The digest of ``[0, size)`` of ``fd``: the rest hashed from a mapping of it.

        A mapping, not ``pread``: the pages are in the page cache, just written, and
        hashing them in place saves a copy of every byte (about a third of the CPU).
        Only for our own temporary file, whose size nobody else changes. Each block's
        pages are unmapped once hashed (``MADV_DONTNEED``; they stay in the page cache), so
        the mapping never holds more than one block of the chunk in this process's memory.
        """
        if self.upto < size:
            try:
                mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except (OSError, ValueError):  # a file system that cannot map: read instead
                mapped = None
            if mapped is None:
                for pos in range(self.upto, size, _HASH_BLOCK):
                    self.hasher.update(os.pread(fd, min(_HASH_BLOCK, size - pos), pos))
            else:
                with mapped:
                    view = memoryview(mapped)
                    try:
                        for pos in range(self.upto, size, _HASH_BLOCK):
                            end = min(pos + _HASH_BLOCK, size)
                            self.hasher.update(view[pos:end])
                            page = pos - pos % mmap.PAGESIZE
                            mapped.madvise(mmap.MADV_DONTNEED, page, end - page)
                    finally:
                        view.release()
            self.upto = size
        return self.hasher.hexdigest()


_REWRITTEN = (
    "changed since this reader opened index.json (the dataset was rewritten at this URL; "
    "open it again to read the new version)"
)


def _damaged(
    url: str, spent: RetryBudget, seen: ObjectInfo | None, exc: ChecksumMismatchError
) -> ChecksumMismatchError:
    """The error once every download in the retry budget differed from the index while
    the object kept the index's size (and its ETag, as far as one was seen)."""
    tag = f" and its ETag {seen.etag}" if seen is not None and seen.etag else ""
    why = str(exc).removeprefix(f"{url}: ")
    return ChecksumMismatchError(
        f"{url}: does not match the index.json this reader opened in "
        f"{spent.failures} downloads in a row ({why}); it kept the index's size{tag}, so "
        "it is damaged where it is stored or on every way here, or was rewritten with the "
        "same size before this reader first fetched it (then open the dataset again)"
    )


def _verify_fd(tmp: TempFile, spec: ChunkSpec, url: str, hashed: _Hashed | None) -> None:
    """Check the downloaded bytes against the index (a mismatch may be damage in transit:
    the caller decides, see :meth:`Downloader._changed`)."""
    assert tmp.fd is not None
    actual_size = os.fstat(tmp.fd).st_size
    if actual_size != tmp.size:
        raise ChecksumMismatchError(f"{url}: got {actual_size} bytes, the index says {tmp.size}")
    if spec.checksum:
        actual = hashed.finish(tmp.fd, tmp.size) if hashed else file_checksum(tmp.fd, tmp.size)
        if actual != spec.checksum.lower():
            raise ChecksumMismatchError(
                f"{url}: xxh3_64 {actual}, the index says {spec.checksum}"
                f" (would be cached as {tmp.final})"
            )


def _publish_adopted(tmp: TempFile, store: ChunkStore, name: str) -> None:
    """Publish ``tmp``, then release the publisher's pin of ``name`` (see
    :meth:`.ChunkStore.adopt`) whether the publish succeeded or not."""
    published = False
    try:
        tmp.publish()
        published = True
    finally:
        store.settle(name, published)


def _verify_and_publish(
    tmp: TempFile,
    spec: ChunkSpec,
    url: str,
    hashed: _Hashed | None,
    store: ChunkStore,
    adopted: Callable[[], object],
) -> None:
    """:func:`_verify_fd`, then the publish, in one hand-off to a thread (one wake-up of
    a thread and one of the loop fewer per chunk than two hand-offs). A durable chunk
    the store adopts (:meth:`.ChunkStore.adopt`) is served before its fsync: ``adopted``
    is called (it schedules the loop's part: handing the path out) before
    :func:`_publish_adopted`."""
    _verify_fd(tmp, spec, url, hashed)
    if not spec.checksum:
        tmp.stamp = None  # nothing to check it against in a later boot: fsync it
    if tmp.fsyncs and store.adopt(spec.name, tmp):
        adopted()
        _publish_adopted(tmp, store, spec.name)
    else:
        tmp.publish()


def _md5_of(fd: int, size: int) -> str:
    """The hex MD5 of the first ``size`` bytes of ``fd`` (an ETag to compare with)."""
    h = hashlib.md5(usedforsecurity=False)
    for pos in range(0, size, _HASH_BLOCK):
        h.update(os.pread(fd, min(_HASH_BLOCK, size - pos), pos))
    return h.hexdigest()


def _matches(checksum: str, fd: int, size: int) -> bool:
    """The file ``fd`` of ``size`` bytes has the xxh3_64 ``checksum``."""
    return file_checksum(fd, size) == checksum.lower()


def _verify_path(path: str, spec: ChunkSpec, url: str) -> tuple[int, ...]:
    """Check the file at ``path`` against ``spec``; returns the identity of the file checked."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if spec.size is not None and size != spec.size:
            raise ChecksumMismatchError(f"{url}: {size} bytes, index says {spec.size}")
        if spec.checksum and file_checksum(fd, size) != spec.checksum.lower():
            raise ChecksumMismatchError(f"{url}: xxh3_64 differs from the index")
        return file_identity(st)
    finally:
        os.close(fd)
