"""Byte ranges of a chunk read into memory, for items wanted before their chunk is here.

The first batch of an epoch need not wait for whole chunks: the reader fetches the few
items it needs by HTTP Range while the chunks keep downloading (see ``docs/cache.md``,
*Range reads for the first batch*). What arrives here is never written to the cache and
never published; it is verified against the chunk once the chunk lands.

The bytes come through :meth:`.Storage.receive_into`, as a chunk's parts do: the S3 and
HTTP backends' own receiver copies each read straight into the range's buffer (aiohttp
only where the receiver leaves a response to it, or with ``ASYNCCACHE_RECEIVE=aiohttp``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import numpy as np

from ..errors import StorageTimeoutError, TransientError
from ..storage.base import Storage
from .link import LinkEstimate
from .parts import next_delay
from .retry import RetryPolicy
from .stats import DownloadStats

__all__ = ["aligned_buffer", "read_range"]

log = logging.getLogger(__name__)

ALIGN = 64  # items start on 64-byte boundaries of the chunk: keep them so in memory


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 array of ``nbytes`` whose first byte is 64-byte aligned."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


async def read_range(
    storage: Storage,
    key: str,
    start: int,
    end: int,
    *,
    policy: RetryPolicy,
    timeout_s: float,
    slot: Callable[[], AbstractAsyncContextManager[None]],
    stats: DownloadStats,
    link: LinkEstimate | None = None,
) -> np.ndarray:
    """Bytes ``[start, end)`` of ``key`` in a 64-byte-aligned buffer.

    Each attempt holds one ``slot()`` and is bounded by ``timeout_s``; a transient
    failure resumes from the first byte not yet received, within ``policy``'s budget.
    A complete first attempt tells ``link`` (optional) its time to first byte and the
    rate of the rest of its body, as a chunk part does.

    Raises:
        RetriesExhaustedError: the retry budget ran out (the last cause chained).
        StorageError: non-transient failures pass through unretried.
    """
    buf = aligned_buffer(end - start)
    sink = _RangeSink(buf, start, end, stats)
    failures = 0
    while True:
        try:
            async with slot():
                stats.range_gets += 1
                sent, sink.first_at, sink.after_first = time.monotonic(), 0.0, 0
                async with asyncio.timeout(timeout_s):
                    await storage.receive_into(key, sink.pos, end, sink)
                pos, first = sink.pos, sink.first_at
                if link is not None and first and pos >= end and not failures:
                    link.observe(first - sent, pos - sink.after_first, time.monotonic() - first)
            if sink.pos < end:
                raise TransientError(
                    f"short body from {storage.object_url(key)} bytes {start}-{end}",
                    url=storage.object_url(key),
                )
            return buf
        except (TransientError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, StorageTimeoutError):
                exc = StorageTimeoutError(
                    f"no complete answer from {storage.object_url(key)} in {timeout_s}s",
                    url=storage.object_url(key),
                )
            failures += 1
            await asyncio.sleep(
                next_delay(storage, key, (start, end), failures, exc, policy, stats)
            )


class _RangeSink:
    """Copies what a request receives into ``buf`` (bytes ``[start, end)`` of the object)
    at the cursor ``pos``, which survives failed attempts (a retry resumes there); notes
    when the attempt's first bytes landed, for the link estimate."""

    __slots__ = ("after_first", "end", "first_at", "mv", "pos", "start", "stats")

    def __init__(self, buf: np.ndarray, start: int, end: int, stats: DownloadStats) -> None:
        self.mv = buf.data  # 1-D, contiguous uint8: format "B"
        self.start, self.end, self.pos, self.stats = start, end, start, stats
        self.first_at = 0.0
        self.after_first = 0

    def write(self, data: bytes | memoryview, /) -> bool:
        pos = self.pos
        n = min(len(data), self.end - pos)
        if n > 0:
            at = pos - self.start
            self.mv[at : at + n] = data[:n] if n < len(data) else data
            self.pos = pos = pos + n
            self.stats.range_bytes += n
            if not self.first_at:
                self.first_at, self.after_first = time.monotonic(), pos
        return pos < self.end

    def closing(self) -> None:
        pass
