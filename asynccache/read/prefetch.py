"""``asynccache.prefetch``: warm the local cache with a whole remote dataset."""

from __future__ import annotations

import os
from typing import Any

from ..config import Settings
from ..download.bulk import prefetch_chunks
from ..download.stats import DownloadStats
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
    nothing (it is read in place). Descriptors, locks and tasks stay bounded whatever the
    number of chunks: they are asked for through a window of ``2 * max_concurrency``, by
    the dataset's one downloader, which is closed (with its session) before returning.
    Shows a byte progress bar unless ``ASYNCCACHE_PROGRESS=0`` or stderr is not a
    terminal.

    Returns:
        What it took: bytes, chunks fetched, hits, retries, bytes/s.

    Raises:
        ObjectNotFoundError, AuthError, RetriesExhaustedError, CacheError: naming the URL
            or the cache directory.
    """
    source = DatasetSource(
        url, cache_dir=cache_dir, storage_options=storage_options, settings=settings
    )
    with source:
        if not source.remote:
            return DownloadStats()
        specs = (source.spec(ci) for ci in range(len(source.index.chunks)))
        return prefetch_chunks(
            source.downloader(),
            specs,
            total_bytes=source.index.total_bytes,
            progress=source.settings.progress and _tty(),
        )


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()
