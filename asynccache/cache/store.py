"""ChunkStore: published chunks of one dataset, pins, and LRU eviction under a byte budget."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bridge import forksafe
from ..config import Settings
from ..errors import CacheError, DiskFullError
from . import pressure, usage
from . import stamp as _stamps
from .eviction import Entry, select_victims
from .layout import (
    DATASET_MARKER,
    LOCK_DIR,
    TempFile,
    dataset_dir,
    ensure_dataset_dir,
    local_name,
    reopen_path,
    sweep_orphans,
)
from .locks import FileLock, in_thread, open_lock_file, try_lock, wait_lock
from .plan import Deferred, PlanPolicy

__all__ = ["ChunkStore"]

log = logging.getLogger(__name__)

EVICT_LOCK = ".evict.lock"
_EVICT_LOCK_TIMEOUT_S = 30.0
_TRIM_WAIT_S = 1.0
_HANDOFF_S = 10.0  # a pin taken for a waiting reader (hand_over) is kept this long at most
_YIELD_S = 0.005  # a file made ahead waits this long for a download's reservation
# A reader's reservation on a full disk tries again after these pauses (doubling) while
# something may be freed, and gives up when nothing in the cache moved for _FULL_STALL_S.
_FULL_RETRY_S = 0.02
_FULL_RETRY_MAX_S = 0.25
_FULL_STALL_S = 30.0
# How far a reservation's first try got (ChunkStore._try_now).
_CREATED = "created"  # the file exists, not admitted (the eviction lock was busy)
_ADMITTED = "admitted"  # admitted, not preallocated (the disk was full for it)
_ALLOCATED = "allocated"  # done


class ChunkStore:
    """The local copies of one dataset's chunks, shared by every process on the node.

    Invariants:
        * A file under its chunk name is complete and verified (see :mod:`.layout`).
          Durable with stamps (:attr:`stamp`): it is served unchecked only when stamped
          in this boot or known on the disk; any other is checked again first
          (:meth:`restamp`), see :mod:`.stamp`.
        * The store reads, counts and removes only what the cache created: dataset
          directories holding the marker, and in them chunk and temporary names. Every
          file it writes has such a name, whatever the index calls the chunk: its local
          name (:func:`.layout.local_name`), which :meth:`path` gives.
        * A pinned chunk is never evicted: a pin holds a shared flock on the file, and the
          evictor removes only files it can lock exclusively without blocking.
        * Eviction keeps the cache's bytes (all datasets) within the budget: the smaller of
          ``max_cache_bytes`` and what the filesystem can hold (free space plus the cache's
          own bytes, less a margin), except for what is pinned or being downloaded at that
          moment; it runs under one cache-wide lock so two processes do not over-evict.
        * A reservation rescans the cache only when the shared ledger (see :mod:`.usage`)
          is old or says the new bytes may not fit.
        * LRU order is shared across processes through file mtimes, touched on every pin.
          With a read plan (:attr:`policy`, see :mod:`.plan`) this dataset's chunks go
          in the plan's order instead, in the places LRU would give them, so the bytes
          taken from each dataset sharing the cache stay what LRU would take.
        * A prefetch (``reserve(..., ahead=True)``) under a plan takes room only from the
          node's prefetch room (:meth:`.plan.PlanPolicy.admits`), else raises
          :class:`.plan.Deferred`: it never forces out a chunk still to be read.
        * Pins are counted per process in memory; the kernel drops the flocks of a dead
          process, so nothing on disk needs cleaning after a crash.
        * A chunk this process downloaded and verified is readable here before it is
          published (:meth:`adopt`): pinned through a duplicate of its temporary file's
          descriptor, which shares the writer's flock (exclusive until the publish, then
          shared, like any pin), and :meth:`pin` returns a path reaching that inode
          (:func:`.layout.reopen_path`) until the publish succeeds. Other processes and
          eviction see only published names.
        * Fork: every descriptor carrying a flock is tracked by :mod:`asynccache.bridge.forksafe`;
          a forked child starts with no pins and fresh mutexes, and the parent's pins and
          locks stay in force, held by the parent alone.
        * A layout deleted underneath (``rm -rf`` of the dataset or cache directory) is
          rebuilt by the next lock, reservation or temporary file.
        * Temporary files made ahead (:meth:`reserve_ahead`) are reservations like any
          other: counted in the ledger and by scans from the moment they exist, locked by
          this process (swept if it dies, never inherited by a child), published only
          through a download that fills and verifies them (:meth:`take_ahead`), and
          removed with their bytes taken off the ledger when no download takes them
          (:meth:`release_ahead`, :meth:`close`).

    Args:
        root: this dataset's directory (see :func:`.layout.dataset_dir`).
        cache_dir: the directory whose total size the budget bounds (``root``'s parent).
        max_cache_bytes: the budget.
        lock_timeout_s: the bound on waiting for another process's download lock.
        durable: a power loss must not leave a chunk that is served unchecked over
            unwritten blocks: each chunk is stamped with the boot it was verified in
            (:mod:`.stamp`), and a chunk from an earlier boot is checked again before its
            first use (:meth:`restamp`); where no stamp can be written, or with ``stamps``
            False, each chunk (and its directory) is fsynced around its publish instead.
        stamps: rely on boot stamps where the file system keeps them (durable only).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_cache_bytes: int,
        cache_dir: str | os.PathLike[str] | None = None,
        lock_timeout_s: float = 600.0,
        durable: bool = True,
        stamps: bool = True,
    ) -> None:
        # Absolute and normalised, as the scans name what they find (usage.scan): a
        # relative cache dir (or one through "..") would never match them, and every
        # chunk of this dataset would be taken for another dataset's (plain LRU).
        self.root = Path(os.path.abspath(root))
        self.cache_dir = self.root.parent if cache_dir is None else Path(os.path.abspath(cache_dir))
        self.max_cache_bytes = max_cache_bytes
        self.lock_timeout_s = lock_timeout_s
        self._pins: dict[str, tuple[int, int]] = {}  # name -> (fd, count)
        self._reached: dict[str, str] = {}  # pinned, not published: name -> reopen_path
        # Pins taken for a waiting reader (hand_over), each counted in _pins: name ->
        # deadlines (monotonic), one a pin; the reader's pin takes one over.
        self._handed: dict[str, list[float]] = {}
        self._mu = threading.Lock()
        self.evicted = 0
        self._amutex: asyncio.Lock | None = None
        self.durable = durable
        self.policy: PlanPolicy | None = None
        self._ready: dict[str, TempFile] = {}  # made ahead, not taken yet (reserve_ahead)
        self._demands = 0  # reservations (not made ahead) waiting for the eviction mutex
        self._closed = False
        # Called on a full disk (any thread): this process's readers drop the mappings of
        # chunks they gave back (an evicted chunk's blocks stay taken while mapped).
        self.shed: Callable[[], object] | None = None
        self._ensure_layout()
        # This boot's id when chunks are stamped rather than fsynced (see .stamp).
        self.stamp: bytes | None = (
            _stamps.probe(self.root / DATASET_MARKER) if durable and stamps else None
        )
        forksafe.register(self)
        swept = sweep_orphans(self.root)
        if swept:
            log.info("asynccache: removed %d orphaned temporary files in %s", len(swept), root)

    @classmethod
    def for_dataset(
        cls, settings: Settings, source_url: str, index_checksum: str, **kwargs: Any
    ) -> ChunkStore:
        """The store of one dataset identity under ``settings.cache_dir``, with its budget."""
        return cls(
            dataset_dir(settings.cache_dir, source_url, index_checksum),
            max_cache_bytes=settings.max_cache_bytes,
            cache_dir=settings.cache_dir,
            **kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"<ChunkStore {self.root} budget={self.max_cache_bytes} pinned={len(self._pins)} "
            f"evicted={self.evicted}>"
        )

    def _ensure_layout(self) -> None:
        """Create (or rebuild) the cache dir, this dataset's directory and its marker."""
        ensure_dataset_dir(self.root)
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cache dir {self.cache_dir}: {exc.strerror or exc}") from exc

    # -- paths ---------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """Where chunk ``name`` (as the index names it) lives once published: under its
        local name (:func:`.layout.local_name`), which the cache counts and evicts."""
        return self.root / local_name(name)

    def lock_path(self, name: str) -> str:
        return str(self.root / LOCK_DIR / f"{local_name(name)}.lock")

    def is_cached(self, name: str, size: int | None = None) -> bool:
        """True when ``name`` is published (and has ``size`` bytes, when given), and may be
        served unchecked (its stamp trusted, see :mod:`.stamp`)."""
        path = self.path(name)
        try:
            st = os.stat(path)
            if size is not None and st.st_size != size:
                return False
            return self.stamp is None or _stamps.trusted(_stamps.read(path), self.stamp)
        except FileNotFoundError:
            return False

    def restamp(self, name: str, size: int, check: Callable[[int, int], bool]) -> bool:
        """Check again a published chunk not trusted as it is (stamped in an earlier boot,
        or never): ``check(fd, size)`` recomputes its checksum. True when it may be served
        now (it matched and is stamped again, or another process did that meanwhile);
        False when it is missing, has another size, is being removed, or does not match
        (the caller downloads it again, and the publish replaces it). Call it holding the
        chunk's download lock. Blocks (reads the file): not on the I/O thread.

        A chunk stamped in an earlier boot was not written since, so the bytes just read
        came from the disk: it is stamped :data:`.stamp.SYNCED`. One never stamped may
        have been written in this boot without a stamp: it gets this boot's.
        """
        boot = self.stamp
        if boot is None:
            return self.is_cached(name, size)
        path = self.path(name)
        # Shared, like a pin: an evictor removing it now makes this a miss.
        fd = _open_locked(str(path), exclusive=False)
        if fd is None:
            return False
        try:
            if os.fstat(fd).st_size != size:
                return False
            old = _stamps.read(fd)
            if _stamps.trusted(old, boot):
                return True
            if not check(fd, size):
                log.warning(
                    "asynccache: %s does not match its checksum (written before a restart "
                    "that lost it?): fetching it again",
                    path,
                )
                return False
            return _stamps.mark(fd, _stamps.SYNCED if old is not None else boot)
        except FileNotFoundError:
            return False
        finally:
            forksafe.close_fd(fd)

    # -- pins ----------------------------------------------------------------------------
    def pin(self, name: str) -> str | None:
        """Protect ``name`` from eviction and mark it used; its path, or None if absent.

        The path is the chunk's own, or, for a chunk adopted here and not published
        (:meth:`adopt`), one that reaches its file only while the pin is held (show
        :func:`.layout.shown_path` of it in messages). Every successful ``pin`` needs one
        :meth:`unpin`. A pin :meth:`hand_over` took for this reader becomes this one.
        Never blocks.
        """
        return self._pin(name, handing=False)

    def hand_over(self, name: str) -> bool:
        """Pin ``name`` for a reader about to :meth:`pin` it (the downloader, as it answers
        a reader waiting for the chunk): the reader's pin takes this one over, so nothing
        evicts the chunk between the answer and the reader's pin (a reader thread may run
        much later than the I/O thread that answered it). A hand-over no reader takes
        (it gave up) is released after ``_HANDOFF_S``, at the next pin or eviction here.
        False where the chunk is not here (:meth:`pin` would find nothing), and once the
        store is closed.
        """
        return self._pin(name, handing=True) is not None

    def _pin(self, name: str, handing: bool) -> str | None:
        path = str(self.path(name))
        if self._handed:
            self._release_stale_handoffs()
        with self._mu:
            if handing and self._closed:
                # A download that lands after the close: no reader takes this pin over,
                # and no pin or eviction of this store would ever release it.
                return None
            held = self._pins.get(name)
            handed = self._handed.get(name)
            if handing:
                self._handed.setdefault(name, []).append(time.monotonic() + _HANDOFF_S)
            if held is not None:
                if handed and not handing:
                    handed.pop()  # the reader's now: the count stays
                    if not handed:
                        del self._handed[name]
                else:
                    self._pins[name] = (held[0], held[1] + 1)
                reached = self._reached.get(name)
                if reached is not None:
                    return reached  # adopted, not published (yet, or ever)
                _touch(path)
                return path
            try:
                fd = forksafe.open_fd(path, os.O_RDONLY)
            except FileNotFoundError:
                self._handed.pop(name, None)
                return None
            try:
                # A miss: an exclusive holder (the lock is not waited for), which is an
                # evictor about to unlink the file or a writer finishing its publish (the
                # download lock path then finds it published); a file unlinked between
                # our open and our lock; a file not trusted as it is (an earlier boot's,
                # see .stamp), which the download path checks again before fetching.
                usable = (
                    try_lock(fd, exclusive=False)
                    and os.fstat(fd).st_ino == os.stat(path).st_ino
                    and (self.stamp is None or _stamps.trusted(_stamps.read(fd), self.stamp))
                )
            except FileNotFoundError:
                usable = False
            if not usable:
                forksafe.close_fd(fd)
                self._handed.pop(name, None)  # (nothing held: no hand-over either)
                return None
            self._pins[name] = (fd, 1)
            _touch(path)
            return path

    def _release_stale_handoffs(self) -> None:
        """Release the pins :meth:`hand_over` took that no reader took over in time; never
        trims (the eviction about to run, or the next one, does)."""
        now = time.monotonic()
        closing = []
        with self._mu:
            for name in [n for n, due in self._handed.items() if min(due) < now]:
                due = self._handed.pop(name)
                live = [d for d in due if d >= now]
                if live:
                    self._handed[name] = live
                fd, count = self._pins[name]
                count -= len(due) - len(live)
                if count > 0:
                    self._pins[name] = (fd, count)
                    continue
                del self._pins[name]
                self._reached.pop(name, None)
                closing.append(fd)
        for fd in closing:
            forksafe.close_fd(fd)

    def unpin(self, name: str) -> None:
        """Undo one :meth:`pin`; the last unpin makes the chunk evictable again."""
        with self._mu:
            held = self._pins.get(name)
            if held is None:
                raise CacheError(f"unpin({name!r}) without a matching pin")
            fd, count = held
            if count > 1:
                self._pins[name] = (fd, count - 1)
                return
            del self._pins[name]
            self._reached.pop(name, None)
            self._handed.pop(name, None)
        forksafe.close_fd(fd)
        self._evict_after_unpin()

    def adopt(self, name: str, tmp: TempFile) -> bool:
        """Pin ``name`` through ``tmp``, complete and verified but not published yet, so
        this process's readers may map it while :meth:`TempFile.publish` runs.

        Holds a duplicate of ``tmp``'s descriptor (tracked by :mod:`asynccache.bridge.forksafe`:
        a forked child never holds it); its flock is the writer's, so sweepers leave the
        file alone and, once published, evictors leave it alone too, until the last pin
        of ``name`` here is gone. One pin is the publisher's: :meth:`settle` releases it.
        False (nothing held) where no path can reach the file across the rename (see
        :func:`.layout.reopen_path`), or when ``name`` is pinned here already.
        """
        assert tmp.fd is not None
        with self._mu:
            if name in self._pins:
                return False
            fd = forksafe.dup_fd(tmp.fd)
            reached = reopen_path(fd)
            if reached is None:
                forksafe.close_fd(fd)
                return False
            self._pins[name] = (fd, 1)
            self._reached[name] = reached
        return True

    def settle(self, name: str, published: bool) -> None:
        """The publish of a chunk :meth:`adopt` took is over: release the publisher's pin.

        Published: later pins get the chunk's own path. Not published (the fsync or the
        rename failed): readers that pinned it keep reading the verified bytes through the
        descriptor, and nothing else finds it (the next download fetches it again). A
        no-op when the store was closed meanwhile (:meth:`close` released every pin).
        """
        with self._mu:
            if name not in self._pins:
                return
            if published:
                self._reached.pop(name, None)
        self.unpin(name)

    def held(self, name: str) -> bool:
        """``name`` is readable here through :meth:`pin` though not published (adopted)."""
        return name in self._reached

    def pinned(self) -> dict[str, int]:
        """Names pinned by this process, with their pin counts."""
        with self._mu:
            return {name: count for name, (_, count) in self._pins.items()}

    # -- writing -------------------------------------------------------------------------
    def download_lock(self, name: str) -> FileLock:
        """The exclusive cross-process lock held while ``name`` downloads."""
        return FileLock(
            self.lock_path(name),
            exclusive=True,
            timeout=self.lock_timeout_s,
            ensure_dir=self._ensure_layout,
        )

    def create_temp(self, name: str, size: int) -> TempFile:
        """A locked, preallocated temporary file that :meth:`TempFile.publish` makes ``name``.

        Does not reserve space: :meth:`reserve` is the way for downloads.
        """
        return self._create(name, size, allocate=True)

    # -- eviction ------------------------------------------------------------------------
    async def reserve(self, name: str, size: int, *, ahead: bool = False) -> TempFile:
        """Make room for ``size`` bytes; the preallocated temporary file that will hold them.

        The file is created first (empty, locked by this process). Then, under the
        cache-wide eviction lock, only the decision: whether the bytes fit, which chunks
        to evict (removed there), and the ledger's record of the reservation (its bytes,
        and the file as pending, so that a scan in another process counts it at its size
        before it has it). The file is preallocated after the lock is let go: on ext4
        creating and preallocating a file each wait for a journal commit in flight, and
        other reservations no longer queue behind that. If the preallocation finds the
        disk full, the lock is taken again to evict for the space really free and try
        once more; failing that the file and its record are removed.
        ``ahead``: a prefetch nobody waits for yet; under a plan it may be deferred.

        A full disk fails a prefetch softly (:class:`.plan.Deferred`), never a reader. A
        reservation a reader waits for that finds the disk full even after evicting marks
        the cache under pressure (:mod:`.pressure`: every process of the node stops
        making files ahead and releases those it made, and defers its prefetches), drops
        this process's files made ahead, and tries again while another process's
        download or pin may still free something and the cache keeps moving (bounded:
        ``lock_timeout_s`` in all, and a while without anything moving).

        Raises:
            Deferred: ``ahead`` and the node's prefetch room is full now, or the disk is.
            DiskFullError: the filesystem cannot take ``size`` more bytes even after
                evicting every unpinned chunk and dropping what was reserved ahead
                (names the directory, and what holds its disk).
        """
        if self.pressed():
            if ahead:
                raise Deferred(name)  # a reader found the disk full moments ago
            if self._ready:
                await self.release_ahead(frozenset())
            self._shed()
        try:
            return await self._reserve(name, size, ahead=ahead)
        except DiskFullError as exc:
            if ahead:
                raise Deferred(name) from exc  # the download starts when a reader asks
        return await self._reserve_when_freed(name, size)

    async def _reserve_when_freed(self, name: str, size: int) -> TempFile:
        """:meth:`reserve` of ``size`` bytes a reader waits for, on a disk found full:
        mark the pressure, drop the files made ahead and the mappings this process's
        readers are done with (:attr:`shed`), and try again as long as something may
        still be freed by waiting and the cache moves (see :mod:`.pressure`)."""
        loop = asyncio.get_running_loop()
        start = moved = loop.time()
        last: tuple[object, ...] | None = None
        delay = _FULL_RETRY_S
        while True:
            pressure.press(self.cache_dir)
            await self.release_ahead(frozenset())
            self._shed()
            with contextlib.suppress(DiskFullError):
                return await self._reserve(name, size, ahead=False)
            pinned = [str(self.path(n)) for n in self.pinned()]
            held = await in_thread(pressure.holding, self.cache_dir, self.root, pinned)
            now = loop.time()
            if held.state != last:
                last, moved = held.state, now
            if (
                not held.may_free
                or now - moved > _FULL_STALL_S
                or now - start > self.lock_timeout_s
            ):
                raise pressure.full_error(self.root, size, held)
            await asyncio.sleep(delay)
            delay = min(2 * delay, _FULL_RETRY_MAX_S)

    def pressed(self) -> bool:
        """A reader of the node found the disk full moments ago (see :mod:`.pressure`)."""
        return pressure.pressed(self.cache_dir)

    def _shed(self) -> None:
        hook = self.shed
        if hook is not None:
            try:
                hook()
            except Exception:  # a hint to free space: never the reservation's failure
                log.debug("asynccache: dropping mappings on a full disk failed", exc_info=True)

    async def _reserve(self, name: str, size: int, *, ahead: bool) -> TempFile:
        """One try of :meth:`reserve` (DiskFullError when even evicting makes no room)."""
        tmp, state = await self._first_try(name, size, ahead=ahead, spare=False)
        try:
            if state == _CREATED:  # the lock was busy: queue for it
                self._demands += 1  # files being made ahead let it go first (reserve_ahead)
                queued = True
                try:
                    async with self._evict_mutex():
                        self._demands -= 1
                        queued = False
                        fd = await self._lock_evict()
                        try:
                            await in_thread(self._reserve_locked, fd, name, tmp, ahead)
                        finally:
                            forksafe.close_fd(fd)
                finally:
                    if queued:
                        self._demands -= 1
            if state != _ALLOCATED:
                await self._allocate(tmp)
        except BaseException:
            # Removed; a record of it is settled by the next holder of the lock.
            tmp.discard()
            raise
        return tmp

    async def _first_try(
        self, name: str, size: int, *, ahead: bool, spare: bool
    ) -> tuple[TempFile, str]:
        """:meth:`_try_now` on a helper thread; when not even an empty file fits (no
        inode, no directory block left), evict for the space really free and create it
        once more (not admitted: the caller queues for the lock)."""
        try:
            return await in_thread(self._try_now, name, size, ahead, spare, undo=_discard_first)
        except DiskFullError:
            if spare:
                raise  # a file made ahead never evicts
        await self._locked(self._free_locked, size)
        try:
            return await in_thread(self._create, name, size, undo=TempFile.discard), _CREATED
        except DiskFullError as exc:
            raise self._full(size) from exc

    def _try_now(self, name: str, size: int, ahead: bool, spare: bool) -> tuple[TempFile, str]:
        """Create ``name``'s temporary file (outside the eviction lock); if the lock is
        free at once, admit it holding the lock, then preallocate it after letting the
        lock go: one helper thread for the whole reservation when nobody else holds the
        lock. Returns the file and how far it got (:data:`_CREATED`, :data:`_ADMITTED`,
        :data:`_ALLOCATED`: the disk was full for it, the caller retries)."""
        policy = self.policy
        if ahead and policy is not None:
            ledger = self._peek_ledger()
            budget = self._budget_hint(ledger)
            if not policy.fits_whole(budget) and self._deferred(name, size, ledger, budget):
                raise Deferred(name)  # no file made for nothing (the lock decides later)
        tmp = self._create(name, size)
        try:
            if spare and self._demands:
                return tmp, _CREATED  # a download waits for its reservation: it goes first
            fd = open_lock_file(str(self.cache_dir / EVICT_LOCK), self._ensure_layout)
            try:
                if not try_lock(fd, exclusive=True):
                    return tmp, _CREATED
                if spare:
                    self._reserve_spare_locked(fd, name, tmp)
                else:
                    self._reserve_locked(fd, name, tmp, ahead)
            finally:
                forksafe.close_fd(fd)  # the lock goes with it
            try:
                tmp.allocate()
            except DiskFullError:
                return tmp, _ADMITTED
            return tmp, _ALLOCATED
        except BaseException:
            tmp.discard()
            raise

    def _create(self, name: str, size: int, *, allocate: bool = False) -> TempFile:
        """The temporary file of ``name``, created and locked (preallocated with
        ``allocate``), publishing as this store does (durable, its boot stamp)."""
        return TempFile(
            self.path(name),
            size,
            durable=self.durable,
            stamp=self.stamp,
            ensure_dir=self._ensure_layout,
            allocate=allocate,
        )

    def _full(self, size: int) -> DiskFullError:
        return DiskFullError(
            f"the disk holding the cache dir {self.root} is full: {size} more bytes "
            "do not fit even after evicting every unpinned chunk"
        )

    async def _allocate(self, tmp: TempFile) -> None:
        """Preallocate ``tmp`` (admitted already) outside the eviction lock; on a full
        disk (fuller than statvfs said: another writer, reserved blocks), evict under the
        lock so it fits in what is really free and try once more there."""
        try:
            await in_thread(tmp.allocate)
            return
        except DiskFullError:
            pass
        await self._locked(self._allocate_locked, tmp)

    async def _locked(self, fn: Any, *args: Any) -> Any:
        """``fn(fd, *args)`` on a helper thread, holding the eviction lock ``fd``."""
        async with self._evict_mutex():
            fd = await self._lock_evict()
            try:
                return await in_thread(fn, fd, *args)
            finally:
                forksafe.close_fd(fd)

    def _free_locked(self, fd: int, size: int) -> None:
        settled = usage.settle(fd, self.cache_dir)
        room = usage.fs_free(self.cache_dir) - settled.unallocated
        used, _, pending = self._evict_locked(size, room, pending=settled.pending)
        usage.write_ledger(fd, used, 0, pending=pending)

    def _allocate_locked(self, fd: int, tmp: TempFile) -> None:
        # Its record is pending: counted in the scan at its size, and in what is not
        # allocated yet, so evicting frees what it still needs.
        settled = usage.settle(fd, self.cache_dir)
        room = usage.fs_free(self.cache_dir) - settled.unallocated
        used, _, pending = self._evict_locked(0, room, pending=settled.pending)
        usage.write_ledger(fd, used, 0, pending=pending)
        try:
            tmp.allocate()
        except DiskFullError as exc:
            tmp.discard()
            usage.settle(fd, self.cache_dir)  # its record and bytes off the ledger now
            raise self._full(tmp.size) from exc

    # -- temporary files made ahead -------------------------------------------------------
    async def reserve_ahead(self, name: str, size: int) -> bool:
        """Reserve ``size`` bytes for ``name`` and make its temporary file now, before its
        download starts, so that the download finds it ready (:meth:`take_ahead`).

        The slow steps of a reservation (the cache-wide lock, another process's
        reservation, creating and preallocating the file, which on ext4 waits for a
        journal commit in flight) then overlap the downloads before it. Only into room
        the cache has now (nothing is evicted for it), and never under a plan whose
        dataset does not fit the budget (there the plan's prefetch room decides what is
        fetched ahead). Never the last room on the disk: the file system keeps room for
        a download of the same size beside it, and none is made while the cache is under
        pressure (see :mod:`.pressure`). True when a file for ``name`` is ready; False when
        none could be made now (no room, a full disk: the download's own reservation then
        evicts or reports it).
        """
        if name in self._ready:
            return True
        if self._closed:
            return False
        if self.pressed():
            # A reader found the disk full: what was made ahead goes, and nothing more.
            await self.release_ahead(frozenset())
            return False
        ledger = self._peek_ledger()
        policy = self.policy
        if policy is not None and not policy.fits_whole(self._budget_hint(ledger)):
            # The plan's prefetch room decides what is fetched ahead: a file made for a
            # chunk past the window would count there as fetched and hold back the window.
            return False
        if (
            ledger is not None
            and ledger.trusted(time.time())
            and ledger.used + size > self.max_cache_bytes
        ):
            return False  # no room as the cache stands: no file made for nothing
        tmp: TempFile | None = None
        try:
            tmp, state = await self._first_try(name, size, ahead=False, spare=True)
            mutex = self._evict_mutex()
            while state == _CREATED:
                async with mutex:
                    if not self._demands:
                        fd = await self._lock_evict()
                        try:
                            await in_thread(self._reserve_spare_locked, fd, name, tmp)
                        finally:
                            forksafe.close_fd(fd)
                        state = _ADMITTED
                if state == _CREATED:
                    # A download waits for its own reservation: it goes first (the mutex
                    # wakes its waiters in order, and this one queues again behind them).
                    await asyncio.sleep(_YIELD_S)
            if state != _ALLOCATED:
                await in_thread(tmp.allocate)
        except (Deferred, CacheError) as exc:
            if tmp is not None:
                tmp.discard()  # a record of it is settled by the next holder of the lock
            log.debug("no temporary file made ahead for %s: %s", name, exc)
            return False
        except BaseException:
            if tmp is not None:
                tmp.discard()
            raise
        # Its download lock file too, if new: creating a file waits for a journal commit
        # in flight just as the temporary file did; opening one that exists does not.
        try:
            await in_thread(self._make_lock_file, name)
        except BaseException:
            tmp.discard()  # cancelled: removed; the next settle takes its bytes off
            raise
        with self._mu:
            keep = not self._closed and name not in self._ready
            if keep:
                self._ready[name] = tmp
        if not keep:
            await self._release([tmp])
        return True

    def _make_lock_file(self, name: str) -> None:
        with contextlib.suppress(CacheError):
            forksafe.close_fd(open_lock_file(self.lock_path(name), self._ensure_layout))

    async def take_ahead(self, name: str, size: int) -> TempFile | None:
        """The temporary file made ahead for ``name`` (``size`` bytes), now the caller's
        to fill, publish or discard; None when there is none (or it is no longer usable:
        then it is released)."""
        with self._mu:
            tmp = self._ready.pop(name, None)
        if tmp is None:
            return None
        if tmp.fd is not None and tmp.size == size and _linked(tmp.fd):
            return tmp
        await self._release([tmp])
        return None

    def ready_ahead(self) -> frozenset[str]:
        """The names whose temporary files are made ahead and not taken yet."""
        with self._mu:
            return frozenset(self._ready)

    async def release_ahead(self, keep: frozenset[str] | set[str]) -> int:
        """Remove the temporary files made ahead for names not in ``keep`` (the hint moved
        on), taking their bytes off the ledger; returns how many were removed."""
        with self._mu:
            drop = [t for n, t in self._ready.items() if n not in keep]
            self._ready = {n: t for n, t in self._ready.items() if n in keep}
        if drop:
            await self._release(drop)
        return len(drop)

    async def _release(self, tmps: list[TempFile]) -> None:
        """Remove ``tmps`` and take their bytes off the ledger, under the eviction lock (a
        scan in between must not see them gone yet counted, or counted twice)."""
        try:
            async with self._evict_mutex():
                fd = await self._lock_evict()
                try:
                    await in_thread(_release_locked, fd, tmps, self.cache_dir)
                finally:
                    forksafe.close_fd(fd)
        finally:
            for tmp in tmps:  # the lock not had (cancelled, timed out): removed, still counted
                tmp.discard()

    def _release_now(self, tmps: list[TempFile]) -> None:
        """:meth:`_release` from sync code: the eviction lock is waited for briefly
        (bounded, like a trim); without it the files are removed and left counted."""
        path = str(self.cache_dir / EVICT_LOCK)
        try:
            fd = open_lock_file(path, self._ensure_layout)
        except CacheError:
            fd = None
        try:
            if fd is not None:
                deadline = time.monotonic() + _TRIM_WAIT_S
                while not try_lock(fd, exclusive=True):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
                else:
                    _release_locked(fd, tmps, self.cache_dir)
        finally:
            for tmp in tmps:
                tmp.discard()
            if fd is not None:
                forksafe.close_fd(fd)

    def _evict_mutex(self) -> asyncio.Lock:
        # In-process callers queue here, so only one of them waits on the flock.
        if self._amutex is None:
            self._amutex = asyncio.Lock()
        return self._amutex

    async def _lock_evict(self) -> int:
        """The cache-wide eviction lock, held exclusively: a tracked descriptor."""
        path = str(self.cache_dir / EVICT_LOCK)
        fd = open_lock_file(path, self._ensure_layout)
        await wait_lock(fd, True, _EVICT_LOCK_TIMEOUT_S, path)  # closes fd on failure
        return fd

    def budget(self) -> int:
        """The bytes this cache may hold: ``max_cache_bytes``, or less where its file
        system holds less (what the cache holds now plus the room left). The one answer
        to "what is the budget" above the store."""
        room = self._room()
        if room >= self.max_cache_bytes:
            return self.max_cache_bytes  # (no scan needed: the disk is no limit)
        return self._budget_of(usage.scan(self.cache_dir, self.root).used, room)

    def steady_budget(self) -> int:
        """The budget as every process of the node sees it at any moment: ``max_cache_bytes``,
        or the file system's size less its margin where that is smaller. Unlike
        :meth:`budget`, it does not follow what other files take meanwhile, so choices that
        every reader must make alike (the shuffle window a dataset is read with)
        are made from it."""
        return min(self.max_cache_bytes, self.disk_bytes())

    def fits(self, nbytes: int) -> bool:
        """``nbytes`` fit in :meth:`budget` (a whole dataset, a plan's minimum)."""
        return nbytes <= self.budget()

    def disk_bytes(self) -> int:
        """The most this cache could ever hold on its file system: its size less the
        margin kept free (:func:`.usage.fs_capacity`)."""
        try:
            return usage.fs_capacity(self.cache_dir)
        except FileNotFoundError:
            self._ensure_layout()
            return usage.fs_capacity(self.cache_dir)

    def _room(self) -> int:
        """What the filesystem can still take, less the margin (rebuilds a deleted dir)."""
        try:
            return usage.fs_room(self.cache_dir)
        except FileNotFoundError:
            self._ensure_layout()
            return usage.fs_room(self.cache_dir)

    def _reserve_locked(self, fd: int, name: str, tmp: TempFile, ahead: bool = False) -> None:
        """Admit ``tmp`` (created, empty): evict what must go, record its bytes and its
        entry. The caller holds the eviction lock ``fd``; nothing here waits for the
        journal but the evictions' unlinks."""
        size = tmp.size
        settled = usage.settle(fd, self.cache_dir)
        ledger = settled.ledger
        now = time.time()
        # What the filesystem can take, less what is admitted and not allocated yet.
        room = self._room() - settled.unallocated
        if ahead and self.policy is not None:
            if ledger is not None and ledger.trusted(now):
                used = ledger.used
            else:
                used = self._scan(settled)
            if self._deferred(name, size, ledger, self._budget_of(used, room)):
                raise Deferred(name)
        if (
            ledger is not None
            and ledger.trusted(now)
            and ledger.used + size <= self.max_cache_bytes
            and size <= room
        ):
            used, count, at = ledger.used, ledger.reservations + 1, ledger.scanned_at
            pending = settled.pending
        else:
            used, _, pending = self._evict_locked(size, room, ahead=ahead, pending=settled.pending)
            count, at = 0, now
        self._admit_locked(fd, tmp, pending, used + size, count, at)

    def _deferred(self, name: str, size: int, ledger: usage.Ledger | None, budget: int) -> bool:
        """A prefetch of ``name`` waits: under a plan whose dataset does not fit the
        budget (``budget``: the setting, or less where the file system holds less), the
        node's prefetch room cannot take it now."""
        policy = self.policy
        return (
            policy is not None
            and not policy.fits_whole(budget)
            # The whole cache, this chunk included, within the prefetch room: so is what
            # this dataset has fetched ahead (no need to look).
            and not (
                ledger is not None
                and ledger.trusted(time.time())
                and ledger.used + size <= budget - policy.min_bytes
            )
            and not policy.admits(local_name(name), size, usage.present(self.root), budget)
        )

    def _budget_of(self, used: int, room: int) -> int:
        """The budget, the cache holding ``used`` bytes and its file system ``room`` more:
        ``max_cache_bytes``, or less where the file system holds less. Prefetching plans
        with it: on a disk smaller than the setting, bytes fetched ahead would take the
        room a reader's download needs."""
        return max(0, min(self.max_cache_bytes, used + room))

    def _budget_hint(self, ledger: usage.Ledger | None) -> int:
        """:meth:`_budget_of` as far as the shared ledger (read without the lock) says:
        a hint, the lock decides."""
        if ledger is None:
            return self.max_cache_bytes
        try:
            room = self._room()
        except OSError:
            return self.max_cache_bytes
        return self._budget_of(ledger.used, room)

    def _scan(self, settled: usage.Settled) -> int:
        """Bytes the cache holds (a full scan; the pending reservations at their sizes)."""
        return usage.scan(self.cache_dir, self.root, settled.pending).used

    def _peek_ledger(self) -> usage.Ledger | None:
        """The ledger as it stands, read without the lock (a hint: the lock decides)."""
        try:
            fd = open_lock_file(str(self.cache_dir / EVICT_LOCK), self._ensure_layout)
        except CacheError:
            return None
        try:
            return usage.read_ledger(fd)
        finally:
            forksafe.close_fd(fd)

    def _admit_locked(
        self, fd: int, tmp: TempFile, pending: list[usage.Pending], used: int, count: int, at: float
    ) -> None:
        assert tmp.fd is not None
        entry = usage.pending_of(str(tmp.path), tmp.fd, tmp.size, self.cache_dir)
        # The bytes and the entry in one write: never an entry whose bytes were not
        # counted (settling would take them off).
        usage.write_ledger(fd, used, count, at, [*pending, entry])

    def _reserve_spare_locked(self, fd: int, name: str, tmp: TempFile) -> None:
        """:meth:`_reserve_locked` without evicting: :class:`.plan.Deferred` when the
        bytes do not fit as the cache stands."""
        size = tmp.size
        settled = usage.settle(fd, self.cache_dir)
        ledger = settled.ledger
        now = time.time()
        limit = self.max_cache_bytes
        room = self._room() - settled.unallocated
        if ledger is not None and ledger.trusted(now) and ledger.used + size <= limit:
            used, count, at = ledger.used, ledger.reservations + 1, ledger.scanned_at
            pending = settled.pending
        else:
            used, _, pending = usage.scan(self.cache_dir, self.root, settled.pending)
            count, at = 0, now
        # A file made ahead never takes the last room: a download of its size still fits.
        if used + size > limit or 2 * size > room:
            if count == 0:
                usage.write_ledger(fd, used, count, at, pending)  # a fresh scan: keep it
            raise Deferred(name)
        self._admit_locked(fd, tmp, pending, used + size, count, at)

    async def make_room(self, incoming: int) -> int:
        """Evict least-recently-used unpinned chunks so ``incoming`` more bytes fit.

        Returns the number of bytes removed. Runs the directory scan off the loop.
        """
        async with self._evict_mutex():
            fd = await self._lock_evict()
            try:
                return await in_thread(self._make_room_locked, fd, incoming)
            finally:
                forksafe.close_fd(fd)

    def _make_room_locked(self, fd: int, incoming: int) -> int:
        settled = usage.settle(fd, self.cache_dir)
        used, removed, pending = self._evict_locked(
            incoming, self._room() - settled.unallocated, pending=settled.pending
        )
        usage.write_ledger(fd, used, 0, pending=pending)
        return removed

    def _evict_locked(
        self,
        incoming: int,
        room: int,
        *,
        pending: list[usage.Pending],
        ahead: bool = False,
    ) -> tuple[int, int, list[usage.Pending]]:
        """Scan, then evict LRU chunks so ``incoming`` fits the budget; (used, removed,
        the entries of ``pending`` still pending: see :class:`.usage.Scan`, and write the
        ledger with them).

        The budget is ``max_cache_bytes``, or less when the filesystem can take only
        ``room`` more bytes. The caller holds the eviction lock and has settled the
        pending reservations (``pending``: counted at their sizes). ``ahead`` (a prefetch,
        under a plan): only chunks no reader needs again this epoch may make room for it;
        when they are not enough, :class:`.plan.Deferred` (what was evicted stays evicted:
        nobody needed it this epoch).
        """
        if self._handed:
            self._release_stale_handoffs()
        used, entries, pending = usage.scan(self.cache_dir, self.root, pending)
        budget = min(self.max_cache_bytes, used + room)
        pinned_here = {str(self.path(name)) for name in self.pinned()}
        candidates = [e for e in entries if e.key not in pinned_here]
        removed = 0
        policy = self.policy
        spare: frozenset[str] | None = None
        if policy is not None and used + incoming > budget:
            order = self._plan_order(policy, candidates)
            if ahead:
                root = str(self.root)
                own = [os.path.basename(e.key) for e in order if os.path.dirname(e.key) == root]
                spare = frozenset(policy.spare(own))
        else:
            order = select_victims(candidates, used=used, budget=budget, incoming=incoming)
        for victim in order:
            if used + incoming - removed <= budget:
                break
            if (
                spare is not None
                and os.path.dirname(victim.key) == str(self.root)
                and os.path.basename(victim.key) not in spare
            ):
                continue  # still to be read this epoch: a prefetch never forces it out
            if _remove_if_unlocked(victim.key):
                removed += victim.size
                self.evicted += 1
        if spare is not None and used + incoming - removed > budget:
            raise Deferred("no room for a prefetch without evicting a chunk still to be read")
        return used - removed, removed, pending

    def _plan_order(self, policy: PlanPolicy, candidates: list[Entry]) -> list[Entry]:
        """Every candidate, in eviction order: least recently used first, except that the
        places this dataset's chunks hold in that order go to them in the plan's order."""
        lru = sorted(candidates, key=lambda e: (e.last_used, e.key))
        root = str(self.root)
        own = {os.path.basename(e.key): e for e in lru if os.path.dirname(e.key) == root}
        keys = {e.key for e in own.values()}
        planned = iter(policy.victims(list(own), {n: e.last_used for n, e in own.items()}))
        return [own[next(planned)] if e.key in keys else e for e in lru]

    def _evict_after_unpin(self) -> None:
        """Pins may have kept the cache over budget: trim it now that one is released.

        Only when the shared ledger says the cache is over budget (or cannot be read).
        Another process (or this one's I/O thread) may be evicting: wait for it, briefly
        and bounded (an eviction is a scan and a few unlinks), then trim; if the wait runs
        out, the next reservation trims instead.
        """
        path = str(self.cache_dir / EVICT_LOCK)
        try:
            fd = open_lock_file(path, self._ensure_layout)
        except CacheError:
            return  # nothing to trim in a cache we cannot open; the next reserve reports
        try:
            ledger = usage.read_ledger(fd)
            if ledger is not None and ledger.used <= self.max_cache_bytes:
                return
            deadline = time.monotonic() + _TRIM_WAIT_S
            while not try_lock(fd, exclusive=True):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)
            self._make_room_locked(fd, 0)
        finally:
            forksafe.close_fd(fd)

    def used_bytes(self) -> int:
        """Bytes the cache holds now: chunks and temporary files, all datasets."""
        return usage.scan(self.cache_dir, self.root).used

    def close(self) -> None:
        """Release every pin this store holds, and the temporary files made ahead (no
        more are kept after this); then trim the cache to its budget, as the last unpin
        would."""
        with self._mu:
            pins, self._pins = self._pins, {}
            self._reached = {}
            self._handed = {}
            ready, self._ready = list(self._ready.values()), {}
            self._closed = True
        for fd, _ in pins.values():
            forksafe.close_fd(fd)
        if ready:
            self._release_now(ready)
        if pins:
            # Those pins may have kept the cache over budget (an unpin's trim that found
            # another process evicting gave up): trim now, not at the next reservation.
            with contextlib.suppress(OSError, CacheError):
                self._evict_after_unpin()

    def _after_fork_in_child(self) -> None:
        # forksafe closed the pin descriptors and the files made ahead already: forget
        # them, never close twice (the files are the parent's to use or remove).
        self._mu = threading.Lock()
        self._amutex = None
        self._demands = 0
        self._pins = {}
        self._reached = {}
        self._handed = {}
        self._ready = {}
        self.shed = None  # the parent's readers


def _release_locked(fd: int, tmps: list[TempFile], cache_dir: Path) -> None:
    """Remove ``tmps`` and take their bytes off the ledger in ``fd`` (held exclusively):
    settling drops the records whose files are gone, with their bytes."""
    for tmp in tmps:
        tmp.discard()
    usage.settle(fd, cache_dir)


def _discard_first(result: tuple[TempFile, str]) -> None:
    result[0].discard()


def _linked(fd: int) -> bool:
    """The file behind ``fd`` still has a name (not deleted underneath)."""
    try:
        return os.fstat(fd).st_nlink > 0
    except OSError:
        return False


def _touch(path: str) -> None:
    # A read-only cache still works; LRU order just degrades to publish order.
    with contextlib.suppress(OSError):
        os.utime(path)


def _open_locked(path: str, *, exclusive: bool) -> int | None:
    """A descriptor of ``path`` holding a flock taken without blocking (tracked by
    :mod:`asynccache.bridge.forksafe`; the caller closes it), or None when the file is gone, the
    lock is held elsewhere, or the name went to another file meanwhile."""
    try:
        fd = forksafe.open_fd(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if try_lock(fd, exclusive=exclusive) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except FileNotFoundError:
        pass
    forksafe.close_fd(fd)
    return None


def _remove_if_unlocked(path: str) -> bool:
    """Unlink ``path`` if nobody pins it; the exclusive non-blocking flock decides."""
    fd = _open_locked(path, exclusive=True)
    if fd is None:
        return False
    try:
        os.unlink(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except FileNotFoundError:
        return False
    finally:
        forksafe.close_fd(fd)
