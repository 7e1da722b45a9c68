"""``DatasetSource``: one dataset opened for reading, wherever it lives.

It reads ``index.json`` (only that) when opened, and turns a chunk number into a local
file path: in place for a local directory, through the downloader and the shared local
cache for a remote URL. It is cheap to pickle: a copy sent to a DataLoader worker
reconnects lazily in that process (its own I/O thread, its own sessions). A copy
inherited by a forked child does the same: it starts with a new mutex and forgets the
parent's storage, store and downloader (they live on the parent's I/O thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Iterable
from typing import Any

from . import forksafe
from .bridge import get_loop_thread
from .cache.store import ChunkStore
from .config import Settings
from .download.downloader import ChunkSpec, Downloader
from .download.retry import RetryPolicy
from .download.stats import DownloadStats
from .errors import (
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorageTimeoutError,
    TransientError,
)
from .format import INDEX_NAME, ChunkEntry, Index
from .storage import open_storage
from .storage.base import Storage


def is_remote(url: str) -> bool:
    """True for URLs that need the downloader (anything but a path or ``file://``)."""
    return "://" in url and not url.startswith("file://")


def local_dir(url: str) -> str:
    return url.removeprefix("file://")


class DatasetSource:
    """Index and chunk paths of one dataset. Thread-safe; see the module docstring.

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
        self.settings = settings
        self.settings.configure_logging()
        self.cache_dir = settings.cache_dir
        self.storage_options = dict(storage_options or {})
        self.remote = is_remote(self.url)
        self._aws_env = Settings.aws_env() if self.remote else {}
        self._mu = threading.Lock()
        self._storage: Storage | None = None
        self._store: ChunkStore | None = None
        self._downloader: Downloader | None = None
        self._pid = -1
        forksafe.register(self)
        self.index = self._read_index()

    # -- opening -------------------------------------------------------------------
    def _read_index(self) -> Index:
        if not self.remote:
            path = os.path.join(local_dir(self.url), INDEX_NAME)
            try:
                with open(path, "rb") as f:
                    return Index.from_json(f.read(), path)
            except FileNotFoundError as exc:
                raise ObjectNotFoundError(
                    f"{path}: no dataset here (index.json is missing)", url=path
                ) from exc
        storage = self._connect()
        policy = RetryPolicy(
            self.settings.retries, self.settings.backoff_base_s, self.settings.backoff_max_s
        )

        async def fetch() -> bytes:
            failures = 0
            while True:
                try:
                    return await asyncio.wait_for(storage.read(INDEX_NAME), self.settings.timeout_s)
                except (TransientError, asyncio.TimeoutError) as exc:
                    failures += 1
                    if not policy.should_retry(failures):
                        url = storage.object_url(INDEX_NAME)
                        raise RetriesExhaustedError(
                            f"gave up on {url} after {failures} attempts; last error: "
                            f"{exc or type(exc).__name__}",
                            url=url,
                            attempts=failures,
                        ) from exc
                    await asyncio.sleep(policy.delay(failures, getattr(exc, "retry_after", None)))

        budget = (self.settings.timeout_s + self.settings.backoff_max_s) * (
            self.settings.retries + 1
        )
        text = get_loop_thread().call(fetch(), budget)
        return Index.from_json(text, storage.object_url(INDEX_NAME))

    def _connect(self) -> Storage:
        """This process's storage backend (made anew in a forked or spawned child)."""
        with self._mu:
            if self._pid != os.getpid() or self._storage is None:
                self._storage = open_storage(
                    self.url, self.settings, self.storage_options, self._aws_env
                )
                get_loop_thread().register_closer(self._storage.close)
                self._store, self._downloader = None, None
                self._pid = os.getpid()
            return self._storage

    def downloader(self) -> Downloader:
        """The downloader of this process (remote datasets only)."""
        storage = self._connect()
        with self._mu:
            if self._downloader is None:
                self._store = ChunkStore.for_dataset(
                    self.settings, self.url, self.index.checksum, durable=self.settings.durable
                )
                self._downloader = Downloader(storage, self._store, self.settings)
                # Closers run newest first: downloads are cancelled before sessions close.
                get_loop_thread().register_closer(self._downloader.cancel_all)
            return self._downloader

    # -- chunks --------------------------------------------------------------------
    def spec(self, ci: int) -> ChunkSpec:
        e = self.index.chunks[ci]
        return ChunkSpec(e.filename, e.bytes, e.checksum.split(":", 1)[1])

    def acquire(self, ci: int, entry: ChunkEntry | None = None) -> str:
        """Local path of chunk ``ci``, downloaded if needed and pinned against eviction.

        Every ``acquire`` of a remote chunk needs a :meth:`release`. Bounded: the
        downloader's retry budget and stall timeout bound the wait.
        """
        entry = entry or self.index.chunks[ci]
        if not self.remote:
            return os.path.join(local_dir(self.url), entry.filename)
        dl = self.downloader()
        spec = self.spec(ci)
        budget = (self.settings.timeout_s + self.settings.backoff_max_s) * (
            self.settings.retries + 2
        )
        for _ in range(8):  # a pin can lose a race with another process's evictor: refetch
            fut = dl.ensure(spec.name, spec.size, spec.checksum)
            try:
                fut.result(timeout=budget)
            except concurrent.futures.TimeoutError as exc:
                fut.cancel()
                raise StorageTimeoutError(
                    f"{self.url}/{entry.filename}: not downloaded within {budget:.0f}s",
                    url=self.url,
                ) from exc
            assert self._store is not None
            path = self._store.pin(spec.name)
            if path is not None:
                return path
        raise TransientError(
            f"{self.url}/{entry.filename}: evicted again right after "
            "download; ASYNCCACHE_MAX_CACHE_BYTES is too small",
            url=self.url,
        )

    def release(self, ci: int) -> None:
        """Undo one :meth:`acquire` (no-op for local datasets)."""
        if self.remote and self._store is not None and self._pid == os.getpid():
            self._store.unpin(self.index.chunks[ci].filename)

    def hint(self, chunks: Iterable[int]) -> None:
        """These chunks come next, in this order: download them ahead (remote only)."""
        if self.remote:
            self.downloader().hint([self.spec(ci) for ci in chunks])

    @property
    def stats(self) -> DownloadStats:
        with self._mu:
            dl = self._downloader if self._pid == os.getpid() else None
        return dl.stats.snapshot() if dl else DownloadStats()

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the mutex at the fork; the parent's connection is
        # bound to the parent's I/O thread. Reconnect lazily, like an unpickled copy.
        self._mu = threading.Lock()
        self._storage, self._store, self._downloader = None, None, None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_storage", "_store", "_downloader"):
            state[k] = None
        state["_pid"] = -1
        del state["_mu"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mu = threading.Lock()
        forksafe.register(self)

    def __repr__(self) -> str:
        return f"DatasetSource({self.url!r}, items={self.index.total_items})"
