"""Byte ranges of a chunk read into memory, for items wanted before their chunk is here.

The first batch of an epoch need not wait for whole chunks: the reader fetches the few
items it needs by HTTP Range while the chunks keep downloading (see ``docs/cache.md``,
*Range reads for the first batch*). What arrives here is never written to the cache and
never published. A range may come with a :class:`RangeCheck`: its bytes are then verified
as soon as they arrive, before the range is handed to anyone, fetched again when they
don't match (within the retry budget, as a damaged chunk is), and a mismatch that
persists is told apart as a rewritten object or a damaged one.

The bytes come through :meth:`.Storage.receive_into`, as a chunk's parts do: the S3 and
HTTP backends' own receiver copies each read straight into the range's buffer (aiohttp
only where the receiver leaves a response to it, or with ``ASYNCCACHE_RECEIVE=aiohttp``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import numpy as np

from ..errors import (
    ChecksumMismatchError,
    DatasetRewrittenError,
    StorageError,
    StorageTimeoutError,
    TransientError,
)
from ..format.memory import HUGE_FROM, fresh_bytes
from ..storage.base import ObjectInfo, Storage
from .link import LinkEstimate
from .parts import retry_wait
from .retry import RetryPolicy
from .stats import DownloadStats

__all__ = ["RangeCheck", "aligned_buffer", "read_range"]

log = logging.getLogger(__name__)

ALIGN = 64  # items start on 64-byte boundaries of the chunk: keep them so in memory


#: What the bytes of a range must be: None when they are right, else what differs (for
#: the message, e.g. the item and key whose checksum does not match).
Check = Callable[[np.ndarray], str | None]

_STALE = (
    "changed since this reader opened index.json (the dataset was rewritten at this URL; "
    "open it again to read the new version)"
)


@dataclasses.dataclass(frozen=True)
class RangeCheck:
    """How the bytes of one range are verified on arrival.

    Attributes:
        size: the object's size as the index records it.
        check: the verification of the range's bytes (see :data:`Check`).
        origin: ``(start, end, check)`` of the range whose bytes ``check`` relies on (a
            chunk's header, holding the checksums of its items), or None when ``check``
            relies on the index alone. When the range does not match, ``origin`` is read
            again: if it no longer matches the index either, the object was rewritten.
    """

    size: int
    check: Check
    origin: tuple[int, int, Check] | None = None


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 array of ``nbytes`` whose first byte is 64-byte aligned (a large
    one in base pages: :func:`.fresh_bytes`)."""
    if nbytes >= HUGE_FROM:
        return fresh_bytes(nbytes)  # (page-aligned)
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
    verify: RangeCheck | None = None,
) -> np.ndarray:
    """Bytes ``[start, end)`` of ``key`` in a 64-byte-aligned buffer; with ``verify``,
    only bytes that passed it.

    Each attempt holds one ``slot()`` and is bounded by ``timeout_s``; a transient
    failure resumes from the first byte not yet received, within ``policy``'s budget
    (faults against its retries, throttling answers against its patience, see
    :class:`.RetryBudget`).
    A complete first attempt tells ``link`` (optional) its time to first byte and the
    rate of the rest of its body, as a chunk part does.

    Bytes that fail ``verify`` are fetched again, whole, up to ``policy.retries`` times
    (bits flip in transit): a mismatch is not counted against the transient failures'
    budget, nor they against its. Before that, at the first mismatch, the object's size
    and ETag are asked for (HEAD) and ``verify.origin`` is read again: a size other than
    the index's, or an origin that no longer matches, means the object was rewritten,
    and no retry can help.

    Raises:
        DatasetRewrittenError: the object no longer matches the index: its size changed,
            its ETag changed while it was read, ``verify.origin`` no longer matches, or
            it is gone. Names the URL, the bytes and what ``verify`` found.
        ChecksumMismatchError: the range failed ``verify`` on every attempt while the
            object stayed the same (damaged where it is stored, or on every way to it).
            Names the URL, the bytes and what ``verify`` found.
        RetriesExhaustedError: the retry budget ran out (the last cause chained).
        ThrottleTimeoutError: throttled past the patience (names it and the URL).
        StorageError: non-transient failures pass through unretried.
    """
    buf = aligned_buffer(end - start)
    sink = _RangeSink(buf, start, end, stats)
    budget = policy.budget()
    mismatches = 0
    seen: ObjectInfo | None = None  # the object at the first mismatch
    origin_ok = False  # verify.origin was read again then and still matched the index
    while True:
        try:
            async with slot():
                stats.range_gets += 1
                sent, sink.first_at, sink.after_first = time.monotonic(), 0.0, 0
                async with asyncio.timeout(timeout_s):
                    await storage.receive_into(key, sink.pos, end, sink)
                pos, first = sink.pos, sink.first_at
                failed = budget.failures + budget.throttles + mismatches
                if link is not None and first and pos >= end and not failed:
                    link.observe(first - sent, pos - sink.after_first, time.monotonic() - first)
            if sink.pos < end:
                raise TransientError(
                    f"short body from {storage.object_url(key)} bytes {start}-{end}",
                    url=storage.object_url(key),
                )
            what = verify.check(buf) if verify is not None else None
            if what is None:
                return buf
            assert verify is not None
            mismatches += 1
            url = storage.object_url(key)
            log.debug("%s bytes %d-%d do not match (%s)", url, start, end, what)
            now = await _head(storage, key, timeout_s)
            if mismatches == 1:
                seen = now
                changed = _size_changed(now, verify.size)
                if changed is None and verify.origin is not None:
                    changed, origin_ok = await _origin_changed(
                        storage, key, verify.origin, policy, timeout_s, slot, stats
                    )
            else:
                changed = _size_changed(now, verify.size) or _etag_changed(seen, now)
            if changed is not None:
                raise DatasetRewrittenError(
                    f"{url}: {_STALE}: {changed}; bytes {start}-{end} read by range: {what}"
                )
            if not policy.should_retry(mismatches):
                etag = f"ETag {now.etag}" if now is not None and now.etag else "ETag"
                why = (
                    "the object is damaged where it is stored or on every way to it (its "
                    "header still matches the index: a rewrite would have changed it)"
                    if origin_ok
                    else "the object was rewritten with the same size before this reader "
                    "first read it, or is damaged where it is stored or on every way to it"
                )
                raise ChecksumMismatchError(
                    f"{url}: bytes {start}-{end} read by range: {what}, on all {mismatches} "
                    f"attempts, while its size and {etag} stayed the same: {why}"
                )
            stats.retries += 1
            sink.pos = start  # fetched again whole: any of its bytes may be the bad one
            await asyncio.sleep(policy.delay(mismatches))
            continue
        except (TransientError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, StorageTimeoutError):
                exc = StorageTimeoutError(
                    f"no complete answer from {storage.object_url(key)} in {timeout_s}s",
                    url=storage.object_url(key),
                )
            await asyncio.sleep(retry_wait(storage, key, (start, end), budget, exc, stats))


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


async def _head(storage: Storage, key: str, timeout_s: float) -> ObjectInfo | None:
    """The object's size and ETag now, or None when the storage can't tell within
    ``timeout_s`` (a failed HEAD is no evidence of a rewrite).

    Raises:
        DatasetRewrittenError: the object is gone.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await storage.head(key)
    except (StorageError, TimeoutError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise _gone(storage, key) from exc
        log.debug("HEAD %s failed: %r", storage.object_url(key), exc)
        return None


def _gone(storage: Storage, key: str) -> DatasetRewrittenError:
    return DatasetRewrittenError(f"{storage.object_url(key)}: {_STALE}: the object is gone")


def _size_changed(now: ObjectInfo | None, size: int) -> str | None:
    if now is not None and now.size != size:
        return f"it has {now.size} bytes, the index says {size}"
    return None


def _etag_changed(seen: ObjectInfo | None, now: ObjectInfo | None) -> str | None:
    if seen is not None and now is not None and seen.etag and now.etag and seen.etag != now.etag:
        return f"its ETag changed from {seen.etag} to {now.etag} while it was read"
    return None


async def _origin_changed(
    storage: Storage,
    key: str,
    origin: tuple[int, int, Check],
    policy: RetryPolicy,
    timeout_s: float,
    slot: Callable[[], AbstractAsyncContextManager[None]],
    stats: DownloadStats,
) -> tuple[str | None, bool]:
    """The range ``origin`` (the chunk header the failed range was checked against) read
    again: what differs when it no longer matches the index (else None), and whether it
    was read and matched. A failure to read it says nothing: ``(None, False)``."""
    lo, hi, check = origin
    try:
        got = await read_range(
            storage, key, lo, hi, policy=policy, timeout_s=timeout_s, slot=slot, stats=stats
        )
    except StorageError as exc:
        if isinstance(exc, FileNotFoundError):
            raise _gone(storage, key) from exc
        return None, False
    what = check(got)
    return (None, True) if what is None else (f"bytes {lo}-{hi} read again: {what}", False)
