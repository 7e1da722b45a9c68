"""DownloadStats: what the downloader did, for ``repr()``, logs and benchmarks."""

from __future__ import annotations

import dataclasses
import time

__all__ = ["DownloadStats"]


@dataclasses.dataclass
class DownloadStats:
    """Counters of one downloader. Updated on the I/O thread only; read anywhere.

    ``busy_s`` counts wall time with at least one download in flight, so ``bytes_per_s``
    is the throughput while working, not diluted by idle time. ``peak_inflight`` is the
    most downloads that were in flight at once.
    """

    bytes: int = 0
    chunks_fetched: int = 0
    hits: int = 0
    misses: int = 0
    retries: int = 0
    deferred: int = 0  # prefetches the store deferred: the node's prefetch room was full
    range_gets: int = 0  # range requests for items wanted before their chunk landed
    range_bytes: int = 0  # their bytes (held in memory, never cached)
    splits: int = 0  # parts whose rest went to a request of its own (a straggler split)
    restamped: int = 0  # chunks of an earlier boot checked again and kept (cache/stamp.py)
    wait_s: float = 0.0
    busy_s: float = 0.0
    peak_inflight: int = 0
    _active: int = dataclasses.field(default=0, repr=False)
    _busy_since: float = dataclasses.field(default=0.0, repr=False)

    @property
    def bytes_per_s(self) -> float:
        busy = self.busy_s + (time.monotonic() - self._busy_since if self._active else 0.0)
        return self.bytes / busy if busy > 0 else 0.0

    def started(self) -> None:
        if self._active == 0:
            self._busy_since = time.monotonic()
        self._active += 1
        self.peak_inflight = max(self.peak_inflight, self._active)

    def finished(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.busy_s += time.monotonic() - self._busy_since

    def snapshot(self) -> DownloadStats:
        """A copy, safe to keep while the downloader goes on."""
        return dataclasses.replace(self)

    def __str__(self) -> str:
        return (
            f"fetched={self.chunks_fetched} bytes={self.bytes} hits={self.hits} "
            f"misses={self.misses} retries={self.retries} deferred={self.deferred} "
            f"range_gets={self.range_gets} "
            f"MB/s={self.bytes_per_s / 1e6:.1f} wait_s={self.wait_s:.3f}"
        )
