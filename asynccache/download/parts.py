"""Fetch one byte range of an object into a temporary file, with retries and resume."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from ..cache.layout import TempFile
from ..errors import RetriesExhaustedError, StorageTimeoutError, TransientError
from ..storage.base import Storage
from .retry import RetryPolicy
from .stats import DownloadStats

__all__ = ["Hasher", "fetch_range", "split_parts"]


class Hasher(Protocol):
    """What ``fetch_range`` needs of a streaming hash (``xxhash.xxh3_64`` fits)."""

    def update(self, data: bytes, /) -> None: ...


log = logging.getLogger(__name__)


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
) -> None:
    """Write bytes ``[start, end)`` of ``key`` at the same offsets of ``out``.

    ``hasher`` (optional) is fed every byte in order; resuming keeps that true, since a
    retry continues exactly after the last byte fed.

    A transient failure (5xx, 429, reset, short body, ``timeout_s`` without a byte) is
    retried after a backoff, resuming from the first byte not yet received. Each
    attempt holds one ``slot()`` of the process's concurrency limit while its request is
    open, and not while it sleeps.

    Raises:
        RetriesExhaustedError: the retry budget ran out; names the URL, the attempts and
            the last cause (chained).
        StorageError: non-transient failures (not found, auth) pass through unretried.
    """
    cursor = [start]  # the next byte to fetch; survives failed attempts (resume)
    failures = 0
    while True:
        try:
            async with slot():
                await _stream(storage, key, cursor, end, out, timeout_s, stats, hasher)
            if cursor[0] < end:
                raise TransientError(
                    f"short body from {storage.object_url(key)}: {cursor[0] - start} of "
                    f"{end - start} bytes",
                    url=storage.object_url(key),
                )
            return
        except TransientError as exc:
            failures += 1
            if not policy.should_retry(failures):
                raise RetriesExhaustedError(
                    f"gave up on {storage.object_url(key)} bytes {start}-{end} after "
                    f"{failures} attempts; last error: {exc}",
                    url=storage.object_url(key),
                    attempts=failures,
                ) from exc
            stats.retries += 1
            delay = policy.delay(failures, exc.retry_after)
            log.debug("retrying %s at byte %d in %.2fs: %s", key, cursor[0], delay, exc)
            await asyncio.sleep(delay)


async def _stream(
    storage: Storage,
    key: str,
    cursor: list[int],
    end: int,
    out: TempFile,
    timeout_s: float,
    stats: DownloadStats,
    hasher: Hasher | None,
) -> None:
    """One attempt: copy what arrives to ``out``, advancing ``cursor[0]`` as bytes land."""
    pos = cursor[0]
    pieces = storage.iter_range(key, pos, end).__aiter__()
    watchdog = _StallWatchdog(timeout_s)
    try:
        async for piece in pieces:
            watchdog.progress()
            if len(piece) > end - pos:
                piece = piece[: end - pos]
            out.pwrite(piece, pos)
            if hasher is not None:
                hasher.update(piece)
            pos += len(piece)
            cursor[0] = pos
            stats.bytes += len(piece)
            if pos >= end:
                break
    except asyncio.CancelledError:
        if not watchdog.fired:
            raise
        watchdog.uncancel()
        raise StorageTimeoutError(
            f"no bytes from {storage.object_url(key)} for {timeout_s}s at byte {pos}",
            url=storage.object_url(key),
        ) from None
    finally:
        watchdog.close()
        await _aclose(pieces)


class _StallWatchdog:
    """Cancels the current task when no progress was reported for ``timeout_s``.

    One timer per ``timeout_s`` rather than one per piece: pieces can be a few KiB, and a
    ``wait_for`` per piece would cost a task each.
    """

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._timeout_s = timeout_s
        self._last = self._loop.time()
        self.fired = False
        self._handle = self._loop.call_later(timeout_s, self._check)

    def progress(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        idle = self._loop.time() - self._last
        if idle >= self._timeout_s:
            self.fired = True
            if self._task is not None:
                self._task.cancel()
        else:
            self._handle = self._loop.call_later(self._timeout_s - idle, self._check)

    def uncancel(self) -> None:
        """Withdraw our own cancel request (Python 3.11+ counts them)."""
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()

    def close(self) -> None:
        self._handle.cancel()


async def _aclose(pieces: object) -> None:
    aclose = getattr(pieces, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):  # best-effort cleanup of a failed stream
            await asyncio.wait_for(aclose(), 5.0)
