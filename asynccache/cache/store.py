"""ChunkStore: published chunks of one dataset, pins, and LRU eviction under a byte budget."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from ..config import Settings
from ..errors import CacheError
from .eviction import Entry, select_victims
from .layout import LOCK_DIR, TempFile, cache_error, dataset_dir, is_temp_name, sweep_orphans
from .locks import FileLock, in_thread, try_lock, wait_lock

__all__ = ["ChunkStore"]

log = logging.getLogger(__name__)

EVICT_LOCK = ".evict.lock"
_EVICT_LOCK_TIMEOUT_S = 30.0
_TRIM_WAIT_S = 1.0


class ChunkStore:
    """The local copies of one dataset's chunks, shared by every process on the node.

    Invariants:
        * A file under its chunk name is complete and verified (see :mod:`.layout`).
        * A pinned chunk is never evicted: a pin holds a shared flock on the file, and the
          evictor removes only files it can lock exclusively without blocking.
        * Eviction keeps the bytes under ``cache_dir`` (all datasets) within
          ``max_cache_bytes``, except for what is pinned or being downloaded at that moment;
          it runs under one cache-wide lock so two processes do not over-evict.
        * LRU order is shared across processes through file mtimes, touched on every pin.
        * Pins are counted per process in memory; the kernel drops the flocks of a dead
          process, so nothing on disk needs cleaning after a crash.
        * A forked child starts with no pins: it closes its inherited copies of the
          parent's pin descriptors (the parent's pins stay in force).

    Args:
        root: this dataset's directory (see :func:`.layout.dataset_dir`).
        cache_dir: the directory whose total size the budget bounds (``root``'s parent).
        max_cache_bytes: the budget.
        lock_timeout_s: the bound on waiting for another process's download lock.
        durable: fsync each chunk (and its directory) before and after publishing it, so
            a power loss cannot leave a published name over unwritten blocks.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_cache_bytes: int,
        cache_dir: str | os.PathLike[str] | None = None,
        lock_timeout_s: float = 600.0,
        durable: bool = True,
    ) -> None:
        self.root = Path(root)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else self.root.parent
        self.max_cache_bytes = max_cache_bytes
        self.lock_timeout_s = lock_timeout_s
        self._pins: dict[str, tuple[int, int]] = {}  # name -> (fd, count)
        self._mu = threading.Lock()
        self.evicted = 0
        self._estimate = 0  # bytes under cache_dir at our last scan, plus our reservations
        self._amutex: asyncio.Lock | None = None
        self.durable = durable
        try:
            (self.root / LOCK_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise cache_error(exc, self.root) from exc
        _STORES.add(self)
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

    # -- paths ---------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """Where chunk ``name`` lives once published."""
        return self.root / name

    def lock_path(self, name: str) -> str:
        return str(self.root / LOCK_DIR / f"{name}.lock")

    def is_cached(self, name: str, size: int | None = None) -> bool:
        """True when ``name`` is published (and has ``size`` bytes, when given)."""
        try:
            st = os.stat(self.path(name))
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    # -- pins ----------------------------------------------------------------------------
    def pin(self, name: str) -> str | None:
        """Protect ``name`` from eviction and mark it used; its path, or None if absent.

        Every successful ``pin`` needs one :meth:`unpin`. Never blocks.
        """
        path = str(self.path(name))
        with self._mu:
            held = self._pins.get(name)
            if held is not None:
                self._pins[name] = (held[0], held[1] + 1)
                _touch(path)
                return path
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                # Non-blocking: an exclusive holder is an evictor about to unlink the file
                # (a miss), or a writer finishing its publish (treated as a miss too; the
                # download lock path then finds the file published).
                if not try_lock(fd, exclusive=False):
                    os.close(fd)
                    return None
                # The evictor may have unlinked the file between our open and our lock.
                if os.fstat(fd).st_ino != os.stat(path).st_ino:
                    os.close(fd)
                    return None
            except FileNotFoundError:
                os.close(fd)
                return None
            self._pins[name] = (fd, 1)
            _touch(path)
            return path

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
        os.close(fd)
        self._evict_after_unpin()

    def pinned(self) -> dict[str, int]:
        """Names pinned by this process, with their pin counts."""
        with self._mu:
            return {name: count for name, (_, count) in self._pins.items()}

    # -- writing -------------------------------------------------------------------------
    def download_lock(self, name: str) -> FileLock:
        """The exclusive cross-process lock held while ``name`` downloads."""
        return FileLock(self.lock_path(name), exclusive=True, timeout=self.lock_timeout_s)

    def create_temp(self, name: str, size: int) -> TempFile:
        """A locked, preallocated temporary file that :meth:`TempFile.publish` makes ``name``."""
        return TempFile(self.path(name), size, durable=self.durable)

    # -- eviction ------------------------------------------------------------------------
    async def reserve(self, name: str, size: int) -> TempFile:
        """Make room for ``size`` bytes, then create the temporary file that will hold them.

        Both happen under the cache-wide eviction lock, so a concurrent reservation in
        another process sees this one's (preallocated) bytes and evicts for both.
        """
        async with self._evict_mutex():
            lock = self.cache_dir / EVICT_LOCK
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            await wait_lock(fd, True, _EVICT_LOCK_TIMEOUT_S, str(lock))
            try:
                return await in_thread(self._reserve_locked, name, size, undo=TempFile.discard)
            finally:
                os.close(fd)

    def _evict_mutex(self) -> asyncio.Lock:
        # In-process callers queue here, so only one of them waits on the flock.
        if self._amutex is None:
            self._amutex = asyncio.Lock()
        return self._amutex

    def _reserve_locked(self, name: str, size: int) -> TempFile:
        self._evict_locked(size)
        tmp = self.create_temp(name, size)
        self._estimate += size
        return tmp

    async def make_room(self, incoming: int) -> int:
        """Evict least-recently-used unpinned chunks so ``incoming`` more bytes fit.

        Returns the number of bytes removed. Runs the directory scan off the loop.
        """
        async with self._evict_mutex():
            lock = self.cache_dir / EVICT_LOCK
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            await wait_lock(fd, True, _EVICT_LOCK_TIMEOUT_S, str(lock))
            try:
                return await in_thread(self._evict_locked, incoming)
            finally:
                os.close(fd)

    def _evict_locked(self, incoming: int) -> int:
        used, entries = _scan(self.cache_dir)
        pinned_here = {str(self.path(name)) for name in self.pinned()}
        candidates = [e for e in entries if e.key not in pinned_here]
        removed = 0
        for victim in select_victims(
            candidates, used=used, budget=self.max_cache_bytes, incoming=incoming
        ):
            if used + incoming - removed <= self.max_cache_bytes:
                break
            if _remove_if_unlocked(victim.key):
                removed += victim.size
                self.evicted += 1
        self._estimate = used - removed
        return removed

    def _evict_after_unpin(self) -> None:
        """Pins may have kept the cache over budget: trim it now that one is released.

        Only when this process's last view of the cache was over budget. Another
        process (or this one's I/O thread) may be evicting: wait for it, briefly and
        bounded (an eviction is a scan and a few unlinks), then trim; if the wait runs
        out, the next reservation trims instead.
        """
        if self._estimate <= self.max_cache_bytes:
            return
        lock = self.cache_dir / EVICT_LOCK
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            deadline = time.monotonic() + _TRIM_WAIT_S
            while not try_lock(fd, exclusive=True):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)
            self._evict_locked(0)
        finally:
            os.close(fd)

    def used_bytes(self) -> int:
        """Bytes under ``cache_dir`` now (published, pinned and temporary files)."""
        return _scan(self.cache_dir)[0]

    def close(self) -> None:
        """Release every pin this store holds."""
        with self._mu:
            pins, self._pins = self._pins, {}
        for fd, _ in pins.values():
            os.close(fd)

    def _after_fork_in_child(self) -> None:
        self._mu = threading.Lock()
        self._amutex = None
        pins, self._pins = self._pins, {}
        for fd, _ in pins.values():
            with contextlib.suppress(OSError):
                os.close(fd)


_STORES: weakref.WeakSet[ChunkStore] = weakref.WeakSet()


def _reset_stores_in_child() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_stores_in_child)


def _touch(path: str) -> None:
    # A read-only cache still works; LRU order just degrades to publish order.
    with contextlib.suppress(OSError):
        os.utime(path)


def _scan(cache_dir: Path) -> tuple[int, list[Entry]]:
    """Total bytes under ``cache_dir`` and the published chunks, with their mtimes."""
    used = 0
    entries: list[Entry] = []
    try:
        datasets = [d for d in os.scandir(cache_dir) if d.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return 0, []
    for dataset in datasets:
        try:
            files = list(os.scandir(dataset.path))
        except FileNotFoundError:
            continue
        for f in files:
            try:
                if not f.is_file(follow_symlinks=False):
                    continue
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            size = st.st_blocks * 512 if is_temp_name(f.name) else st.st_size
            used += max(size, st.st_size)
            if not is_temp_name(f.name):
                entries.append(Entry(f.path, st.st_size, st.st_mtime))
    return used, entries


def _remove_if_unlocked(path: str) -> bool:
    """Unlink ``path`` if nobody pins it; the exclusive non-blocking flock decides."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not try_lock(fd, exclusive=True):
            return False
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            return False
        os.unlink(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
