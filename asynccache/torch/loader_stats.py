"""``LoaderStats``: a loader's download statistics and its cache's occupancy."""

from __future__ import annotations

import dataclasses

from .fetcher import FetcherStats

__all__ = ["LoaderStats"]


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """Download statistics of a loader, summed over its process and all its workers.

    Attributes:
        bytes, chunks_fetched, hits, misses, retries: the downloaders' counters.
        wait_s: seconds readers waited for chunks to arrive.
        cached_bytes: what the local cache directory holds now (all datasets in it).
        cache_budget: its budget (``max_cache_bytes``).
        stall: the consumer's waits, from a :class:`Fetcher` (see :meth:`with_stall`).
    """

    bytes: int = 0
    chunks_fetched: int = 0
    hits: int = 0
    misses: int = 0
    retries: int = 0
    wait_s: float = 0.0
    cached_bytes: int = 0
    cache_budget: int = 0
    stall: FetcherStats | None = None

    def with_stall(self, stall: FetcherStats) -> LoaderStats:
        """These statistics with a Fetcher's stall figures (``fetcher.stats``)."""
        return dataclasses.replace(self, stall=stall)

    def __str__(self) -> str:
        text = (
            f"fetched={self.chunks_fetched} bytes={self.bytes} hits={self.hits} "
            f"misses={self.misses} retries={self.retries} wait_s={self.wait_s:.3f} "
            f"cache={self.cached_bytes}/{self.cache_budget}"
        )
        if self.stall is not None:
            text += (
                f" steps={self.stall.steps} stall_pct={self.stall.stall_pct:.1f} "
                f"stall_wait_s={self.stall.wait_s:.3f}"
            )
        return text
