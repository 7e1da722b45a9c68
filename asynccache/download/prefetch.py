"""Download a whole dataset into the cache ahead of training, with a progress bar."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

from tqdm import tqdm

from ..bridge import LoopThread
from ..cache.store import ChunkStore
from ..config import Settings
from ..storage.base import Storage
from .downloader import ChunkSpec, Downloader
from .stats import DownloadStats

__all__ = ["prefetch_dataset"]


def prefetch_dataset(
    storage: Storage,
    store: ChunkStore,
    chunks: Sequence[ChunkSpec],
    settings: Settings,
    progress: bool = True,
    *,
    loop_thread: LoopThread | None = None,
) -> DownloadStats:
    """Bring every chunk in ``chunks`` into ``store``; returns what it took.

    Chunks already cached count as hits. Every download is bounded by the downloader's
    retry budget and stall timeout, so this returns or raises in bounded time. On the
    first failure the remaining downloads are cancelled and the error is raised.
    """
    downloader = Downloader(storage, store, settings, loop_thread=loop_thread)
    bar = tqdm(
        total=sum(c.size or 0 for c in chunks),
        unit="B",
        unit_scale=True,
        desc="prefetch",
        disable=not progress,
    )
    futures = {downloader.ensure(c.name, c.size, c.checksum): c for c in chunks}
    try:
        for fut in concurrent.futures.as_completed(futures):
            fut.result()
            bar.update(futures[fut].size or 0)
    finally:
        for fut in futures:
            fut.cancel()
        bar.close()
        downloader.close()
    return downloader.stats.snapshot()
