"""``asynccache.prefetch``: warm the local cache with a whole remote dataset."""

from __future__ import annotations

import os
from typing import Any

from .config import Settings
from .download.prefetch import prefetch_dataset
from .download.stats import DownloadStats
from .source import DatasetSource


def prefetch(
    url: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    settings: Settings | None = None,
) -> DownloadStats:
    """Download every chunk of the dataset at ``url`` into the local cache.

    Chunks already cached count as hits and are not fetched again; a local dataset needs
    nothing (it is read in place). Shows a byte progress bar unless
    ``ASYNCCACHE_PROGRESS=0`` or stderr is not a terminal.

    Returns:
        What it took: bytes, chunks fetched, hits, retries, bytes/s.

    Raises:
        ObjectNotFoundError, AuthError, RetriesExhaustedError, CacheError: naming the URL
            or the cache directory.
    """
    source = DatasetSource(
        url, cache_dir=cache_dir, storage_options=storage_options, settings=settings
    )
    if not source.remote:
        return DownloadStats()
    dl = source.downloader()
    specs = [source.spec(ci) for ci in range(len(source.index.chunks))]
    return prefetch_dataset(
        dl.storage, dl.store, specs, source.settings, progress=source.settings.progress and _tty()
    )


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()
