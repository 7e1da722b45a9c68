"""``DatasetSource``: one dataset opened for reading, wherever it lives.

It reads ``index.json`` (only that) when opened, and turns a chunk number into a local
file path: in place for a local directory, through the downloader and the shared local
cache for a remote URL. It is cheap to pickle: a copy sent to a DataLoader worker
reconnects lazily in that process (its own I/O thread, its own sessions). A copy
inherited by a forked child does the same: it starts with a new mutex and forgets the
parent's storage, store and downloader (they live on the parent's I/O thread).

What a remote source holds open (an HTTP session, pin descriptors, download tasks) is
released by :meth:`DatasetSource.close`, or when the source is garbage-collected, or at
interpreter exit, whichever comes first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..bridge import forksafe, get_loop_thread
from ..cache import indexfile
from ..cache.layout import check_chunk_names
from ..cache.store import ChunkStore
from ..config import Settings
from ..download.connection import Connection
from ..download.downloader import ChunkSpec, Downloader
from ..download.link import LinkEstimate, endpoint_of, link_for
from ..download.ranges import RangeCheck
from ..download.retry import RetryBudget, RetryPolicy
from ..download.stats import DownloadStats
from ..errors import (
    CorruptIndexError,
    RetriesExhaustedError,
    ThrottledError,
    ThrottleTimeoutError,
    TransientError,
)
from ..format import INDEX_NAME, ChunkEntry, Index
from ..format.index import IndexMeta
from ..storage import open_storage
from .readplan import (
    EpochSpec,
    Fitted,
    PlanCache,
    ReadPlan,
    fit_window,
    raise_if_below,
    raise_if_disk_below,
)

# Chunks hinted past the prefetch window: not fetched yet, but their temporary files are
# made ahead, so their downloads start without a reservation (Downloader._make_ahead).
HINT_PAST = 1

# A chunk downloaded for a reader may be evicted by another process before the reader
# pins it (the node's readers at different points of the epoch disagree on what is still
# needed): it is fetched again, after a short, growing pause, for this long at most.
_PIN_RETRY_S = 5.0
_PIN_PAUSE_S = (0.002, 0.1)  # the first pause, the longest


def is_remote(url: str) -> bool:
    """True for URLs that need the downloader (anything but a path or ``file://``)."""
    return "://" in url and not url.startswith("file://")


def local_dir(url: str) -> str:
    return url.removeprefix("file://")


class _Slot:
    """The current :class:`Connection` of a source; what its finalizer closes.

    Kept apart from the source so the finalizer holds no reference to the source itself.
    """

    __slots__ = ("conn",)

    def __init__(self) -> None:
        self.conn: Connection | None = None

    def close_from_finalizer(self) -> None:
        """Hand the close to the I/O thread: a collection may run while this thread
        holds one of the locks that :meth:`Connection.close` takes."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.loop_thread.post(conn.close)


class DatasetSource:
    """Index and chunk paths of one dataset. Thread-safe; see the module docstring.

    A context manager: leaving the ``with`` block calls :meth:`close`.

    Args:
        url: a directory, ``file://``, ``http(s)://`` or ``s3://`` URL of a written dataset.
        cache_dir: where remote chunks are cached (default ``ASYNCCACHE_CACHE_DIR``).
        storage_options: backend options (endpoint, credentials, ``verify``).
        settings: tuning; default from the environment.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.url = os.fspath(url)
        settings = settings or Settings.from_env()
        if cache_dir is not None:
            settings = dataclasses.replace(settings, cache_dir=os.fspath(cache_dir))
        if not os.path.isabs(settings.cache_dir):
            # Fixed here: a worker started elsewhere (spawn, a fork server) would take a
            # relative cache dir from its own working directory.
            settings = dataclasses.replace(settings, cache_dir=os.path.abspath(settings.cache_dir))
        self.settings = settings
        self.settings.configure_logging()
        self.cache_dir = settings.cache_dir
        self.storage_options = dict(storage_options or {})
        self.remote = is_remote(self.url)
        self._aws_env = Settings.aws_env() if self.remote else {}
        self._mu = threading.Lock()
        self._slot = _Slot()
        self._finalizer = _finalizer(self, self._slot)
        self._plans: PlanCache | None = None
        self._follow: ReadPlan | None = None
        self._follow_pid = 0
        self._readers: weakref.WeakSet[Any] = weakref.WeakSet()  # see add_reader
        forksafe.register(self)
        self.index = self._read_index()

    # -- opening -------------------------------------------------------------------
    def _read_index(self) -> Index:
        if not self.remote:
            return indexfile.read_dir(local_dir(self.url), max_bytes=self.settings.max_index_bytes)
        conn = self._connect()
        storage = conn.storage
        policy = RetryPolicy.of(self.settings)
        url = storage.object_url(INDEX_NAME)
        limit, timeout_s = self.settings.max_index_bytes, self.settings.timeout_s

        async def fetch() -> Index:
            spent = policy.budget()
            while True:
                try:
                    data = await asyncio.wait_for(
                        indexfile.read_bounded(storage, INDEX_NAME, limit), timeout_s
                    )
                    # Judged off the loop (an index can be megabytes). Bytes damaged on
                    # the way (their checksum, or no intact one and refused) are as
                    # transient as a reset: fetch them again.
                    got = await asyncio.to_thread(indexfile.load_fetched, data, url)
                    if isinstance(got, Index):
                        check_chunk_names(got, url)
                        return got
                    indexfile.check_sidecar_size(got, storage.object_url(got.sidecar))
                    return await self._fetch_sidecar(conn, got)
                except RetriesExhaustedError:
                    raise  # a sidecar download spent its own budget (it is a TimeoutError
                    # when throttled past the patience): not to be spent again here
                except (TransientError, asyncio.TimeoutError, CorruptIndexError) as exc:
                    retry_after = getattr(exc, "retry_after", None)
                    delay = spent.next_delay(isinstance(exc, ThrottledError), retry_after)
                    if delay is None:
                        raise _gave_up(url, spent, exc) from exc
                    await asyncio.sleep(delay)

        # Bounded: each attempt by timeout_s, the parse by as much again, the pauses by
        # the policy (faults by backoff_max_s each, throttling by its patience). A sidecar
        # download is bounded by the downloader's own retries and stall timeout.
        budget = policy.worst_case_s(2 * timeout_s)
        try:
            return get_loop_thread().call(fetch(), budget)
        except BaseException:
            self.close()  # a source that failed to open holds nothing open
            raise

    async def _fetch_sidecar(self, conn: Connection, meta: IndexMeta) -> Index:
        """The columns of a version-2 index, fetched into this node's cache like a chunk
        (one GET per node: the cache's download lock) and mapped from there.

        A sidecar whose bytes don't match its checksum on arrival is fetched again by the
        downloader; one damaged in the cache afterwards is removed here, and the caller
        fetches it again (:class:`CorruptIndexError` is transient to it).
        """
        self._identity = meta.sidecar_checksum
        store = self._downloader_of(conn).store
        # A downloader of its own: the sidecar is not a chunk, and the chunk downloader's
        # statistics count chunks.
        side = Downloader(conn.storage, store, self.settings)
        try:
            for _ in range(8):  # a pin can lose a race with another process's evictor
                path = await side.ensure_async(
                    meta.sidecar, meta.sidecar_bytes, meta.sidecar_hex, hand_over=True
                )
                if store.pin(meta.sidecar) is None:  # (evicted before the hand-over)
                    continue
                damaged = False
                try:
                    return await asyncio.to_thread(indexfile.map_sidecar, meta, path)
                except CorruptIndexError:
                    damaged = True
                    raise
                finally:
                    store.unpin(meta.sidecar)  # the mapping holds its own lock
                    if damaged:
                        indexfile.discard(path)
        finally:
            await side.aclose()
        raise TransientError(
            f"{self.url}/{meta.sidecar}: evicted again right after download; "
            "ASYNCCACHE_MAX_CACHE_BYTES is too small",
            url=self.url,
        )

    def _cache_identity(self) -> str:
        """The dataset's identity in the cache: the index checksum (of a version-2 index,
        its sidecar's, known before the sidecar is fetched)."""
        ident = self.__dict__.get("_identity")
        return str(ident) if ident is not None else self.index.checksum

    def _connect(self) -> Connection:
        """This process's connection: made on first use, anew in a forked or spawned child
        and after :meth:`close`."""
        with self._mu:
            conn = self._slot.conn
            if conn is None or conn.pid != os.getpid() or conn.closed:
                # A forked child's copy of the parent's connection is left alone: the
                # parent's abandoned loop thread keeps it referenced (never closed here).
                storage = open_storage(self.url, self.settings, self.storage_options, self._aws_env)
                conn = self._slot.conn = Connection(storage, get_loop_thread())
            return conn

    def _live(self) -> Connection | None:
        """The connection of this process, if one is open (never opens one)."""
        conn = self._slot.conn
        return conn if conn is not None and conn.pid == os.getpid() else None

    def downloader(self) -> Downloader:
        """The downloader of this process (remote datasets only)."""
        return self._downloader_of(self._connect())

    def _downloader_of(self, conn: Connection) -> Downloader:
        with self._mu:
            if conn.downloader is None:
                store = ChunkStore.for_dataset(
                    self.settings,
                    self.url,
                    self._cache_identity(),
                    durable=self.settings.durable,
                    stamps=not self.settings.fsync_publish,
                )
                # Weakly: the store outlives this source in the I/O thread's connections.
                store.shed = functools.partial(_shed_weakly, weakref.ref(self))
                conn.attach(store, Downloader(conn.storage, store, self.settings))
            assert conn.downloader is not None
            return conn.downloader

    def close(self) -> None:
        """Release the HTTP session, pins and downloads of this process. Idempotent.

        Closes the descriptors it holds here (the plan's board, pins, the session's
        sockets). Waits (bounded by ``timeout_s``) for the publishes of chunks this
        process read before their publish ended, so what it read is in the cache once
        this returns; then cancels the downloads and waits (bounded) for them to end, so
        nothing lands in the cache after (a read waiting on one raises
        :class:`.BridgeError`); not for the session to finish closing (the I/O thread
        does that). A closed source opens a new connection if it is used again. Garbage
        collection and interpreter exit close it too.
        """
        self.wait_published()
        with self._mu:
            conn, self._slot.conn = self._slot.conn, None
            follow = self._follow if self._follow_pid == os.getpid() else None
        if conn is not None:
            conn.close()  # not under the lock: the I/O thread may need it to wind down
        if follow is not None:
            follow.close()  # its board's descriptor (opened again if the plan goes on)

    def wait_published(self) -> bool:
        """Wait (bounded by ``timeout_s``) for the publishes of chunks this process read
        before their publish ended; True when none is left. Keeps the connection."""
        conn = self._live()
        if conn is None or conn.closed or conn.downloader is None:
            return True
        return conn.downloader.wait_published(self.settings.timeout_s)

    def __enter__(self) -> DatasetSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- chunks --------------------------------------------------------------------
    def spec(self, ci: int) -> ChunkSpec:
        e = self.index.chunks[ci]
        return ChunkSpec(e.filename, e.bytes, e.checksum.split(":", 1)[1])

    def acquire(self, ci: int, entry: ChunkEntry | None = None) -> str:
        """Local path of chunk ``ci``, downloaded if needed and pinned against eviction.

        Every ``acquire`` of a remote chunk needs a :meth:`release`. Bounded: the
        downloader's retry budget and stall timeout bound the wait. A chunk this process
        just downloaded may be returned before its publish finished: the path then reaches
        it only while pinned (see :meth:`.ChunkStore.pin`); open it before :meth:`release`.
        """
        entry = entry or self.index.chunks[ci]
        if not self.remote:
            return os.path.join(local_dir(self.url), entry.filename)
        conn = self._connect()
        dl = self._downloader_of(conn)
        spec = self.spec(ci)
        self.send_hint()
        self._advance(conn, dl, ci)
        if dl.store.held(spec.name) or (
            not dl.in_flight(spec.name) and dl.store.is_cached(spec.name, spec.size)
        ):
            # Here already (a warm cache, or downloaded and verified here, its publish under
            # way): pinned without a round trip to the I/O thread, which costs milliseconds
            # per chunk on a busy machine. A download still in flight is waited for below
            # (it finishes its bookkeeping after publishing).
            path = dl.store.pin(spec.name)
            if path is not None:
                dl.note_hit(spec.name)
                with self._mu:
                    conn.pinned[spec.name] += 1
                return path
        # A pin can lose a race with another process's evictor: fetched again, pausing a
        # little longer each time, until _PIN_RETRY_S has passed.
        deadline = time.monotonic() + _PIN_RETRY_S
        pause, longest = _PIN_PAUSE_S
        while True:
            # Bounded by progress: a slow but live download is waited for, a stuck one is
            # not; giving up (or an interrupt) cancels the download nobody else wants.
            # Early: answered once verified, while the publish (its fsync) goes on; the
            # pin then reaches the file through the store's own descriptor of it.
            # Handed over: pinned for this thread as the I/O thread answers it, so that
            # no evictor (another process's) takes it before the pin below.
            fut = dl.ensure(spec.name, spec.size, spec.checksum, early=True, hand_over=True)
            dl.wait(fut, spec.name)
            path = dl.store.pin(spec.name)
            if path is not None:
                with self._mu:
                    conn.pinned[spec.name] += 1
                return path
            if time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, longest)
        raise TransientError(
            f"{self.url}/{entry.filename}: evicted again right after "
            "download; ASYNCCACHE_MAX_CACHE_BYTES is too small",
            url=self.url,
        )

    def add_reader(self, reader: Any) -> None:
        """``reader`` (a :class:`~asynccache.read.reader.Reader` of this source) maps what
        :meth:`acquire` gives it: on a full disk this source asks it (``reader.release``)
        to drop its mappings of the chunks it gave back early (see :meth:`shed`). Held
        weakly."""
        self._readers.add(reader)

    def shed(self) -> int:
        """The disk is full: have this process's readers drop their mappings of the chunks
        they are done with and gave back early (an evicted chunk's blocks stay taken while
        a mapping of it lives). Safe from any thread; returns how many were dropped."""
        conn = self._live()
        if conn is None or not self._readers:
            return 0
        with self._mu:
            names = [name for name, count in conn.released_early.items() if count > 0]
        dropped = 0
        for name in names:
            ci = self.index.chunk_number(name)
            if ci is None:
                continue
            for reader in list(self._readers):
                reader.release(ci)  # gives the early release back through release()
                dropped += 1
        return dropped

    def release(self, ci: int) -> None:
        """Undo one :meth:`acquire` (no-op for local datasets)."""
        conn = self._live() if self.remote else None
        if conn is None or conn.store is None or conn.closed:
            return  # the pin went with its connection (closed, or the parent's)
        name = self.index.filename(ci)
        with self._mu:
            if conn.released_early[name] > 0:
                conn.released_early[name] -= 1  # given back already (see _advance)
                return
            if conn.pinned[name] <= 0:
                return  # pinned through an earlier connection, released with it
            conn.pinned[name] -= 1
        conn.store.unpin(name)

    # -- items before their chunk (range reads) -----------------------------------
    @property
    def first_read_bytes(self) -> int:
        """Item bytes a reader may fetch by range per epoch before their chunks land
        (``ASYNCCACHE_FIRST_READ_BYTES``); 0 for a local dataset (read in place)."""
        return self.settings.first_read_bytes if self.remote else 0

    def landed(self, ci: int) -> bool:
        """Chunk ``ci`` is in this node's cache now (always true for a local dataset)."""
        if not self.remote:
            return True
        store = self.downloader().store
        name = self.index.filename(ci)
        return store.held(name) or store.is_cached(name, int(self.index.bytes_per_chunk[ci]))

    def read_ranges(
        self,
        ci: int,
        ranges: list[tuple[int, int]],
        checks: list[RangeCheck | None] | None = None,
    ) -> concurrent.futures.Future[list[np.ndarray]]:
        """A Future of the bytes of each ``[start, end)`` of chunk ``ci``, in memory (see
        :meth:`Downloader.read_ranges`): never cached; each verified on arrival by its
        ``checks`` entry (the reader's, from the index and the chunk's header). Remote
        datasets only."""
        return self.downloader().read_ranges(self.index.filename(ci), ranges, checks)

    def send_hint(self) -> None:
        """Send the hint of :meth:`plan_epoch` to the downloader if not sent yet: once the
        reader's range reads are out (:meth:`Reader.expect`) or it asks for a chunk."""
        held = self.__dict__.pop("_held_hint", None)
        if held is not None and held[0] == os.getpid():
            self.downloader().hint(held[1])

    @property
    def mean_chunk_bytes(self) -> float:
        """The mean size of this dataset's chunks (the prefetch window's depth in chunks
        comes from it, see :meth:`Downloader.window_depth`)."""
        sizes = self.index.bytes_per_chunk
        return float(sizes.mean()) if len(sizes) else 0.0

    def chunk_url(self, ci: int) -> str:
        return f"{self.url.rstrip('/')}/{self.index.filename(ci)}"

    def hint(self, chunks: Iterable[int]) -> None:
        """These chunks come next, in this order: download them ahead (remote only).

        Ignored while this process follows an epoch plan (:meth:`plan_epoch`): the plan
        says what comes next.
        """
        if self.remote and not self.planned:
            self.downloader().hint([self.spec(ci) for ci in chunks])

    def fits_cache(self) -> bool:
        """The whole dataset fits this node's cache budget (the store's answer: the
        setting, or less where the file system holds less). Remote datasets only."""
        return self.downloader().store.fits(int(self.index.bytes_per_chunk.sum()))

    # -- the epoch plan ------------------------------------------------------------
    @property
    def planned(self) -> bool:
        """This process reads by an epoch plan (see :meth:`plan_epoch`)."""
        return self._follow is not None and self._follow_pid == os.getpid()

    def fit_window(self, spec: EpochSpec) -> Fitted:
        """The shuffle window the node reads ``spec``'s order with under this cache's
        budget (the store's steady answer: the setting, or the file system's size where
        that is smaller; not what is free now, which differs from one rank or worker to the
        next, and every reader must read one order): ``spec.window``, or the largest
        smaller one whose plan fits the budget (:func:`~asynccache.read.readplan.fit_window`).
        A local dataset keeps its window.

        Raises:
            ConfigError: the budget is below two of the largest chunk per reader.
            DiskFullError: the cache's file system is smaller than that.
        """
        if not self.remote:
            return Fitted(spec.window, spec.window, 0, 0, 0)
        store = self.downloader().store
        raise_if_disk_below(self.url, str(store.cache_dir), store.disk_bytes(), self.index, spec)
        return fit_window(self.url, self.index, spec, store.steady_budget())

    def plan_epoch(self, spec: EpochSpec, skipped: int = 0) -> None:
        """This process is reader ``spec.place`` of an epoch read in the sampler's order
        ``spec.order`` (see :mod:`asynccache.read.readplan`); remote datasets only.
        ``skipped``: positions of its part this reader skips at the start (its own resume,
        and batches the main process built before it started).

        From here on the cache evicts and prefetches by the whole node's plan (every rank
        and worker reading this dataset this way), this reader's hints come from it, and
        each chunk is unpinned as soon as the reader is done with it.

        Raises:
            ConfigError: the cache budget is below two of the largest chunk per reader
                (the message says that minimum in bytes).
            DiskFullError: the cache's file system is smaller than that minimum.
        """
        if not self.remote:
            return
        conn = self._connect()
        dl = self._downloader_of(conn)
        with self._mu:
            plans = self._plans_for(spec)
            raise_if_disk_below(
                self.url, str(dl.store.cache_dir), dl.store.disk_bytes(), self.index, spec
            )
            raise_if_below(self.url, dl.store.budget(), self.index, spec)
            follow = ReadPlan(self.index, spec, plans, str(dl.store.root), skipped)
            old, self._follow, self._follow_pid = self._follow, follow, os.getpid()
            dl.store.policy = follow.policy
        if old is not None:
            old.close()
        window = spec.window if spec.shuffle else 0
        want = dl.window_depth(self.mean_chunk_bytes) + window + HINT_PAST
        # Sent when the reader starts reading (see send_hint): range reads of its first
        # items must find connections free, not queue behind a prefetch window of parts.
        self._held_hint = (os.getpid(), [self.spec(c) for c in follow.upcoming(want)])

    def _plans_for(self, spec: EpochSpec) -> PlanCache:
        """The node's plans of the way ``spec`` reads, following ``spec``'s epoch (under
        ``_mu``): those held, or new ones when the way changed."""
        plans = self._plans
        if plans is None or not plans.same_way(spec):
            plans = self._plans = PlanCache(self.index, spec)
        else:
            plans.follow(spec)
        return plans

    def plan_node(self, spec: EpochSpec) -> None:
        """Compute the node's plan of the epoch ``spec`` names, and of the next, without
        becoming a reader: DataLoader workers forked after this inherit them, rather than
        each planning every reader of the node again (remote datasets only)."""
        if not self.remote:
            return
        with self._mu:
            plans = self._plans_for(spec)
            plans(spec.epoch, spec.variant(plans.total))
            plans(spec.epoch + 1, 0)

    def _advance(self, conn: Connection, dl: Downloader, ci: int) -> None:
        """Before chunk ``ci`` is fetched: move this reader on in its plan, give back the
        pins of chunks it is done with, and hint what it reads next."""
        if not self.planned:
            return
        follow = self._follow
        assert follow is not None and dl.store is not None
        done: list[str] = []
        with self._mu:
            if not follow.start(ci):
                return
            dl.store.policy = follow.policy
            for name, count in conn.pinned.items():
                if count > 0 and not follow.reads_now_name(name):
                    done += [name] * count
                    conn.released_early[name] += count
                    conn.pinned[name] = 0
            want = (
                dl.window_depth(self.mean_chunk_bytes)
                + (follow.spec.window if follow.spec.shuffle else 0)
                + HINT_PAST
            )
            upcoming = follow.upcoming(want)
        for name in done:
            dl.store.unpin(name)
        if dl.store.pressed():
            self.shed()  # a reader of the node found the disk full: what is done goes
        dl.hint([self.spec(c) for c in upcoming])

    @property
    def plan_min_bytes(self) -> int:
        """The cache bytes this process's epoch plan needs at least (0 without a plan)."""
        follow = self._follow if self.planned else None
        return follow.policy.min_bytes if follow is not None else 0

    @property
    def store(self) -> ChunkStore | None:
        """The local chunk store of this process, once a chunk was asked for (else None)."""
        conn = self._live()
        return conn.store if conn is not None else None

    @property
    def link(self) -> LinkEstimate | None:
        """What this process has measured of the storage's link (see
        :mod:`asynccache.download.link`); None while no connection is open here, and for a
        local dataset. Never opens one."""
        conn = self._live()
        return link_for(endpoint_of(conn.storage)) if conn is not None else None

    @property
    def stats(self) -> DownloadStats:
        conn = self._live()
        dl = conn.downloader if conn is not None else None
        return dl.snapshot() if dl else DownloadStats()

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the mutex at the fork. The parent's connection is
        # bound to the parent's I/O thread: it is recognised by its pid and replaced on
        # first use (Connection.close does nothing in this process).
        self._mu = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_mu", "_slot", "_finalizer", "_readers"):
            del state[k]
        state["_plans"] = state["_follow"] = None  # this process's; a copy plans anew
        state.pop("_held_hint", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mu = threading.Lock()
        self._readers = weakref.WeakSet()
        self._slot = _Slot()
        self._finalizer = _finalizer(self, self._slot)
        forksafe.register(self)

    def __repr__(self) -> str:
        return f"DatasetSource({self.url!r}, items={self.index.total_items})"


def _shed_weakly(ref: weakref.ref[DatasetSource]) -> None:
    source = ref()
    if source is not None:
        source.shed()


def _finalizer(source: DatasetSource, slot: _Slot) -> weakref.finalize:
    """Close ``slot``'s connection when ``source`` is garbage-collected.

    Not at exit: the loop thread's own close runs every connection still registered then,
    and waits for them, while a finalizer could only schedule a close the loop might
    cancel halfway (an "Unclosed client session" warning).
    """
    fin = weakref.finalize(source, slot.close_from_finalizer)
    fin.atexit = False
    return fin


def _gave_up(url: str, spent: RetryBudget, exc: BaseException) -> Exception:
    """The error that ends the index fetch: what failed last, with the URL and attempts
    (throttling past the patience: the patience)."""
    last = str(exc) or type(exc).__name__
    attempts = spent.failures + spent.throttles
    if isinstance(exc, ThrottledError):
        patience = spent.policy.throttle_patience_s
        return ThrottleTimeoutError(
            f"gave up on {url}: throttled {spent.throttles} times over "
            f"{spent.throttled_s:.1f}s of backoff, past the patience of {patience:g}s "
            f"(ASYNCCACHE_THROTTLE_PATIENCE_S); last answer: {last}",
            url=url,
            attempts=attempts,
        )
    message = f"gave up on {url} after {attempts} attempts; last error: {last}"
    refusal = indexfile.refusal_of(exc)
    if refusal is not None:  # refused every time: the index's own fault after all
        return type(refusal)(f"gave up on {url} after {attempts} attempts: {refusal}")
    if isinstance(exc, CorruptIndexError):
        return CorruptIndexError(message)
    return RetriesExhaustedError(message, url=url, attempts=attempts)
