"""The chunk downloader: concurrency limit, single-flight, ranged parts, retries, prefetch."""

from .bulk import prefetch_chunks, prefetch_dataset
from .downloader import ChunkSpec, Downloader, file_checksum
from .retry import RetryPolicy
from .stats import DownloadStats

__all__ = [
    "ChunkSpec",
    "DownloadStats",
    "Downloader",
    "RetryPolicy",
    "file_checksum",
    "prefetch_chunks",
    "prefetch_dataset",
]
