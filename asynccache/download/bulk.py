"""Download a whole dataset into the cache ahead of training, with a progress bar."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterable, Sequence

from tqdm import tqdm

from ..bridge import LoopThread
from ..cache.store import ChunkStore
from ..config import Settings
from ..errors import StorageTimeoutError
from ..storage.base import Storage
from .downloader import ChunkSpec, Downloader
from .stats import DownloadStats

__all__ = ["prefetch_chunks", "prefetch_dataset"]

_SLICE_S = 0.5


def prefetch_chunks(
    downloader: Downloader,
    chunks: Iterable[ChunkSpec],
    *,
    total_bytes: int = 0,
    progress: bool = False,
    window: int | None = None,
) -> DownloadStats:
    """Bring every chunk of ``chunks`` into ``downloader``'s store; returns its stats.

    Invariants:
        * At most ``window`` chunks (default ``2 * max_concurrency``) are asked for at
          once, so descriptors, locks and tasks stay bounded whatever the dataset size:
          a new chunk is asked for only when one is done.
        * Bounded by progress: gives up with ``StorageTimeoutError`` only when none of
          its downloads showed a sign of life for ``downloader.stall_s``; each download
          is bounded by its own retry budget.
        * On the first failure the chunks still in flight are cancelled and the error
          is raised.
    """
    window = window or 2 * downloader.settings.max_concurrency
    todo = iter(chunks)
    pending: dict[concurrent.futures.Future[str], ChunkSpec] = {}
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prefetch", disable=not progress)

    def top_up() -> None:
        while len(pending) < window:
            spec = next(todo, None)
            if spec is None:
                return
            pending[downloader.ensure(spec.name, spec.size, spec.checksum)] = spec

    try:
        top_up()
        last = time.monotonic()
        while pending:
            done, _ = concurrent.futures.wait(
                pending, timeout=_SLICE_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for fut in done:
                spec = pending.pop(fut)
                fut.result()
                bar.update(spec.size or 0)
            now = time.monotonic()
            if done:
                last = now
            elif min(now - last, downloader.idle_s()) > downloader.stall_s:
                raise StorageTimeoutError(
                    f"{downloader.storage.url}: prefetch made no progress for "
                    f"{downloader.stall_s:.0f}s",
                    url=downloader.storage.url,
                )
            top_up()
    finally:
        for fut in pending:
            fut.cancel()
        bar.close()
    return downloader.stats.snapshot()


def prefetch_dataset(
    storage: Storage,
    store: ChunkStore,
    chunks: Sequence[ChunkSpec],
    settings: Settings,
    progress: bool = True,
    *,
    loop_thread: LoopThread | None = None,
) -> DownloadStats:
    """Bring every chunk in ``chunks`` into ``store`` with a downloader of its own.

    Chunks already cached count as hits. See :func:`prefetch_chunks`; the downloader is
    closed (its downloads cancelled) before this returns.
    """
    downloader = Downloader(storage, store, settings, loop_thread=loop_thread)
    try:
        return prefetch_chunks(
            downloader, chunks, total_bytes=sum(c.size or 0 for c in chunks), progress=progress
        )
    finally:
        downloader.close()
