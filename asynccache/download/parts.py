"""Fetch one byte range of an object into a temporary file, with retries and resume."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from ..cache.layout import TempFile
from ..errors import (
    RetriesExhaustedError,
    StorageTimeoutError,
    ThrottledError,
    ThrottleTimeoutError,
    TransientError,
)
from ..storage.base import ACLOSE_S, Storage
from .link import LinkEstimate
from .progress import ProgressClock
from .retry import RetryBudget, RetryPolicy
from .stats import DownloadStats
from .writeback import WRITEBACK_BYTES, request_writeback

__all__ = ["Hasher", "Span", "fetch_range", "retry_wait", "split_parts"]


class Hasher(Protocol):
    """What ``fetch_range`` needs of a streaming hash (``xxhash.xxh3_64`` fits)."""

    def update(self, data: bytes, /) -> None: ...


log = logging.getLogger(__name__)

_ACLOSE_S = ACLOSE_S  # the bound on closing an abandoned response


class Span:
    """One part's bytes ``[start, end)`` while it is fetched: ``cursor`` is the next byte
    to fetch (it survives failed attempts), ``end`` may move down while the part runs
    (:meth:`cut`: the rest goes to a request of its own), ``active`` says whether a
    request of it holds a concurrency slot now.

    Invariants: ``start <= cursor <= end``; ``end`` only moves down, never below the
    cursor; bytes past ``end`` are never written (the request is cut short there).
    Mutated on the I/O thread only.
    """

    __slots__ = ("active", "cursor", "end", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.cursor, self.end = start, start, end
        self.active = False

    @property
    def left(self) -> int:
        """Bytes still to fetch."""
        return self.end - self.cursor

    def cut(self, at: int) -> tuple[int, int]:
        """End this part at ``at`` (``cursor < at < end``); the range it gives up."""
        if not self.cursor < at < self.end:
            raise ValueError(f"cannot cut [{self.cursor}, {self.end}) at {at}")
        rest, self.end = (at, self.end), at
        return rest

    def __repr__(self) -> str:
        state = " active" if self.active else ""
        return f"<Span [{self.start}, {self.end}) at {self.cursor}{state}>"


def split_parts(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of at most ``part_bytes`` covering ``size`` bytes."""
    if size <= 0:
        return [(0, 0)]
    return [(s, min(s + part_bytes, size)) for s in range(0, size, part_bytes)]


async def fetch_range(
    storage: Storage,
    key: str,
    start: int,
    end: int,
    out: TempFile,
    *,
    policy: RetryPolicy,
    timeout_s: float,
    slot: Callable[[], AbstractAsyncContextManager[None]],
    stats: DownloadStats,
    hasher: Hasher | None = None,
    min_bytes_per_s: int = 0,
    progress: ProgressClock | None = None,
    link: LinkEstimate | None = None,
    span: Span | None = None,
) -> None:
    """Write bytes ``[start, end)`` of ``key`` at the same offsets of ``out``.

    ``span`` (optional; ``Span(start, end)``) shares the part's progress and lets the
    caller move its end down while it runs (:meth:`Span.cut`): the request in flight
    stops at the new end (its connection is closed, not drained), and retries ask for
    ``[cursor, end)`` of the new end only.

    ``hasher`` (optional) is fed every byte in order; resuming keeps that true, since a
    retry continues exactly after the last byte fed.

    A transient failure (5xx, 429, reset, short body, ``timeout_s`` without a byte, or
    fewer than ``min_bytes_per_s`` over a ``timeout_s`` window) is retried after a
    backoff, resuming from the first byte not yet received: faults within
    ``policy.retries``, throttling answers within ``policy.throttle_patience_s`` seconds
    of backoff (:class:`.RetryBudget`). ``progress`` (optional) is
    touched as bytes land and attempts start and end, for waiters on other threads.
    ``link`` (optional) is told each complete attempt's time to first byte and body rate.
    Each attempt holds one ``slot()`` of the process's concurrency limit while its request
    is open, and not while it sleeps.

    Raises:
        RetriesExhaustedError: the retry budget ran out; names the URL, the attempts and
            the last cause (chained).
        ThrottleTimeoutError: throttled past the patience (names it and the URL).
        StorageError: non-transient failures (not found, auth) pass through unretried.
    """
    if span is None:
        span = Span(start, end)  # the next byte to fetch survives failed attempts (resume)
    budget = policy.budget()
    while True:
        try:
            async with slot():
                if progress is not None:
                    progress.moved()  # an attempt starts
                span.active = True
                try:
                    await _stream(
                        storage,
                        key,
                        span,
                        out,
                        _Limits(timeout_s, min_bytes_per_s),
                        stats,
                        hasher,
                        progress,
                        link,
                    )
                finally:
                    span.active = False
            if span.cursor < span.end:
                raise TransientError(
                    f"short body from {storage.object_url(key)}: {span.cursor - start} of "
                    f"{span.end - start} bytes",
                    url=storage.object_url(key),
                )
            return
        except TransientError as exc:
            delay = retry_wait(storage, key, (start, span.end), budget, exc, stats)
            if progress is not None:
                progress.quiet(delay)  # a bounded sleep, not a stall
            log.debug("retrying %s at byte %d in %.2fs: %s", key, span.cursor, delay, exc)
            await asyncio.sleep(delay)


def next_delay(
    storage: Storage,
    key: str,
    span: tuple[int, int],
    failures: int,
    exc: TransientError,
    policy: RetryPolicy,
    stats: DownloadStats,
) -> float:
    """Seconds to wait before retrying bytes ``span`` of ``key`` after ``failures``
    failed attempts (the last ``exc``), counted in ``stats``.

    Raises:
        RetriesExhaustedError: ``policy`` allows no more; names the URL, the byte range,
            the attempts and the last cause (chained).
    """
    if not policy.should_retry(failures):
        raise RetriesExhaustedError(
            f"gave up on {storage.object_url(key)} bytes {span[0]}-{span[1]} after "
            f"{failures} attempts; last error: {exc}",
            url=storage.object_url(key),
            attempts=failures,
        ) from exc
    stats.retries += 1
    return policy.delay(failures, exc.retry_after)


def retry_wait(
    storage: Storage,
    key: str,
    span: tuple[int, int],
    budget: RetryBudget,
    exc: TransientError,
    stats: DownloadStats,
) -> float:
    """Seconds to wait before retrying bytes ``span`` of ``key`` after the failed attempt
    ``exc``, spending ``budget`` (a fault counts against the retries, a throttling answer
    against the patience), counted in ``stats``.

    Raises:
        ThrottleTimeoutError: throttled past ``ASYNCCACHE_THROTTLE_PATIENCE_S``, or asked
            to wait longer than the patience left; names the URL and the patience.
        RetriesExhaustedError: faults past the retry budget; names the URL, the byte
            range, the attempts and the last cause (chained).
    """
    throttled = isinstance(exc, ThrottledError)
    delay = budget.next_delay(throttled, exc.retry_after)
    if delay is not None:
        stats.retries += 1
        return delay
    url = storage.object_url(key)
    attempts = budget.failures + budget.throttles
    if throttled:
        patience = budget.policy.throttle_patience_s
        asked = (
            f"; it asked to wait {exc.retry_after:g}s more"
            if exc.retry_after is not None and exc.retry_after > budget.patience_left_s
            else ""
        )
        raise ThrottleTimeoutError(
            f"gave up on {url} bytes {span[0]}-{span[1]}: throttled {budget.throttles} "
            f"times over {budget.throttled_s:.1f}s of backoff{asked}, past the patience of "
            f"{patience:g}s (ASYNCCACHE_THROTTLE_PATIENCE_S); last answer: {exc}",
            url=url,
            attempts=attempts,
        ) from exc
    raise RetriesExhaustedError(
        f"gave up on {url} bytes {span[0]}-{span[1]} after {attempts} attempts; last error: {exc}",
        url=url,
        attempts=attempts,
    ) from exc


class _Limits:
    """What counts as a stall: no byte for ``timeout_s``, or under ``min_bytes_per_s``."""

    __slots__ = ("min_bytes_per_s", "timeout_s")

    def __init__(self, timeout_s: float, min_bytes_per_s: int) -> None:
        self.timeout_s, self.min_bytes_per_s = timeout_s, min_bytes_per_s


class _PartSink:
    """Writes what a request receives at the part's cursor, and keeps the books: the
    watchdog, progress, stats, the streaming hash, early writeback, and the cursor of
    ``span`` (bytes past its end, which may move down meanwhile, are never written)."""

    __slots__ = (
        "after_first",
        "first_at",
        "flushed",
        "hasher",
        "out",
        "pos",
        "progress",
        "span",
        "stats",
        "watchdog",
    )

    def __init__(
        self,
        span: Span,
        out: TempFile,
        stats: DownloadStats,
        hasher: Hasher | None,
        progress: ProgressClock | None,
        watchdog: _StallWatchdog,
    ) -> None:
        self.span, self.out, self.stats = span, out, stats
        self.hasher, self.progress, self.watchdog = hasher, progress, watchdog
        self.pos = span.cursor
        self.first_at = 0.0  # when the first bytes landed
        self.after_first = self.pos  # where the bytes after the first piece begin
        # Chunks fsynced at publish: start writing them back as they arrive.
        self.flushed = self.pos if out.fsyncs and out.fd is not None else None

    def write(self, data: bytes | memoryview, /) -> bool:
        n = len(data)
        self.watchdog.progress(n)
        pos = self.pos
        if not self.first_at:
            self.first_at = time.monotonic()
            self.after_first = pos + n
        if self.progress is not None:
            self.progress.moved(n)
        end = self.span.end  # may have moved down since the request went out (a cut)
        if n > end - pos:
            data, n = data[: end - pos], max(0, end - pos)
        if n:
            self.out.pwrite(data, pos)
            if self.hasher is not None:
                self.hasher.update(data)  # type: ignore[arg-type]  # any buffer will do
            pos += n
            self.pos = self.span.cursor = pos
            self.stats.bytes += n
        flushed = self.flushed
        if flushed is not None and (pos - flushed >= WRITEBACK_BYTES or pos >= end):
            if pos > flushed:
                request_writeback(self.out, flushed, pos - flushed)
            self.flushed = pos
        return pos < end

    def closing(self) -> None:
        if self.progress is not None:
            self.progress.quiet(_ACLOSE_S)  # closing the response is bounded on its own


async def _stream(
    storage: Storage,
    key: str,
    span: Span,
    out: TempFile,
    limits: _Limits,
    stats: DownloadStats,
    hasher: Hasher | None,
    progress: ProgressClock | None,
    link: LinkEstimate | None = None,
) -> None:
    """One attempt: copy what arrives to ``out``, advancing ``span.cursor`` as bytes land,
    up to ``span.end`` as it is when each piece arrives (a cut ends the attempt there).

    A complete attempt tells ``link`` its time from the request to the first piece and
    the rate of the bytes after that piece (one connection's rate).
    """
    sent = time.monotonic()
    watchdog = _StallWatchdog(limits.timeout_s, limits.min_bytes_per_s)
    sink = _PartSink(span, out, stats, hasher, progress, watchdog)
    try:
        await storage.receive_into(key, span.cursor, span.end, sink)
        if link is not None and sink.first_at and sink.pos >= span.end:
            first = sink.first_at
            link.observe(first - sent, sink.pos - sink.after_first, time.monotonic() - first)
    except asyncio.CancelledError:
        if not watchdog.fired:
            raise
        watchdog.uncancel()
        url = storage.object_url(key)
        if watchdog.slow is not None:
            got, window = watchdog.slow
            raise StorageTimeoutError(
                f"stalled: {url} sent {got} bytes in {window:.1f}s at byte {sink.pos}, below "
                f"ASYNCCACHE_MIN_BYTES_PER_S={limits.min_bytes_per_s}",
                url=url,
            ) from None
        raise StorageTimeoutError(
            f"stalled: no bytes from {url} for {limits.timeout_s}s at byte {sink.pos}", url=url
        ) from None
    finally:
        watchdog.close()


class _StallWatchdog:
    """Cancels the current task when no byte arrived for ``timeout_s``, or when fewer than
    ``min_bytes_per_s * timeout_s`` bytes arrived over a window of ``timeout_s`` (a
    trickle counts as a stall; 0 turns that floor off).

    One timer per ``timeout_s`` rather than one per piece: pieces can be a few KiB, and a
    ``wait_for`` per piece would cost a task each. ``slow`` says which rule fired:
    ``(bytes, seconds)`` of the window that fell below the floor, or None.
    """

    def __init__(self, timeout_s: float, min_bytes_per_s: int = 0) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._timeout_s = timeout_s
        self._floor = min_bytes_per_s
        self._last = self._window_start = self._loop.time()
        self._window_bytes = 0
        self.fired = False
        self.slow: tuple[int, float] | None = None
        self._handle = self._loop.call_later(timeout_s, self._check)

    def progress(self, nbytes: int = 0) -> None:
        self._last = self._loop.time()
        self._window_bytes += nbytes

    def _check(self) -> None:
        now = self._loop.time()
        idle = now - self._last
        window = now - self._window_start
        if idle < self._timeout_s and window >= self._timeout_s and self._floor > 0:
            if self._window_bytes < self._floor * window:
                self.slow = (self._window_bytes, window)
                idle = self._timeout_s  # below the floor: a stall
            else:
                self._window_start, self._window_bytes, window = now, 0, 0.0
        if idle >= self._timeout_s:
            self.fired = True
            if self._task is not None:
                self._task.cancel()
        else:
            wait = self._timeout_s - idle
            if self._floor > 0:
                wait = min(wait, self._timeout_s - window)
            self._handle = self._loop.call_later(max(wait, 0.001), self._check)

    def uncancel(self) -> None:
        """Withdraw our own cancel request (Python 3.11+ counts them)."""
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()

    def close(self) -> None:
        self._handle.cancel()
