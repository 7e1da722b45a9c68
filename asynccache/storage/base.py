"""The async storage contract: one small class per URL scheme.

Public methods live here and do the shared work (key validation, error context);
a backend implements the ``_impl`` methods only. Backends raise the
:mod:`asynccache.errors` storage tree and nothing else: lower-layer exceptions
(aiohttp, OSError, botocore) are translated at this boundary, always ``from exc``.

Keys are ``/``-separated paths relative to the backend's root URL (``index.json``,
``chunk-0-3.bin``). A backend object is bound to the event loop it was first used on
(its aiohttp session lives there); create and use it on the I/O thread.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Protocol

import aiofiles

from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What ``head``/``list`` know about one object."""

    key: str
    size: int
    etag: str | None = None


class Sink(Protocol):
    """Where :meth:`Storage.receive_into` puts a range's bytes, in order.

    ``write`` copies ``data`` (a buffer the receiver reuses: do not keep it) at the sink's
    cursor, up to the sink's own end, which may move down while the request runs; it
    returns False once the sink wants no more bytes (the receiver then stops, closing the
    connection rather than draining it). ``closing`` is called before a receiver waits
    for a response to close (a bounded phase, not a stall).
    """

    def write(self, data: bytes | memoryview, /) -> bool: ...

    def closing(self) -> None: ...


#: The bound on closing an abandoned response.
ACLOSE_S = 5.0
#: Uploads of files at least this big go in parts (S3 multipart, Azure blocks): the
#: default of the ``multipart_threshold`` storage option.
UPLOAD_THRESHOLD_BYTES = 64 << 20
#: The size of each uploaded part: the default of the ``part_size`` storage option. (A
#: download's ranged parts are another thing: ``ASYNCCACHE_PART_BYTES``.)
UPLOAD_PART_BYTES = 16 << 20


class Storage(abc.ABC):
    """One dataset root (``s3://bucket/prefix``, ``https://host/path``, a directory)."""

    #: URL of the root, as the user gave it (never contains credentials).
    url: str
    #: True when objects can be read in place from the local file system (no copy).
    is_local: bool = False

    def object_url(self, key: str) -> str:
        """The full URL of ``key``, for messages."""
        return self.url.rstrip("/") + "/" + key

    def local_path(self, key: str) -> str | None:
        """The file path to read ``key`` in place, or None for remote backends."""
        return None

    async def head(self, key: str) -> ObjectInfo:
        """Size (and etag) of ``key``. Raises ObjectNotFoundError when missing."""
        return await self._head_impl(_check_key(key, self.url))

    async def iter_range(
        self, key: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """Yield the bytes ``[start, end)`` of ``key`` (``end=None``: to the end) in pieces.

        A short body (the connection closes before ``end``) raises TransientError after
        yielding what arrived, so a caller can resume from the bytes it already has.
        """
        key = _check_key(key, self.url)
        async for piece in self._iter_range_impl(key, start, end):
            yield piece

    async def receive_into(self, key: str, start: int, end: int, sink: Sink) -> None:
        """Hand the bytes ``[start, end)`` of ``key`` to ``sink`` as they arrive.

        Like :meth:`iter_range` (the same errors; a short body raises TransientError
        after ``sink`` got what arrived), but a backend may receive into its own reused
        buffers with no per-piece objects (the S3 and HTTP backends do, see
        docs/storage.md). Stops early, closing the request, when ``sink.write`` returns
        False.
        """
        await self._receive_into_impl(_check_key(key, self.url), start, end, sink)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """The bytes ``[start, end)`` of ``key`` in memory (for small objects and ranges)."""
        return b"".join([piece async for piece in self.iter_range(key, start, end)])

    async def download(self, key: str, dest: str | os.PathLike[str]) -> int:
        """Write the whole object to ``dest`` (overwriting it); returns its byte count.

        No retries and no atomic publish here: that is the downloader's job.
        """
        n = 0
        async with aiofiles.open(dest, "wb") as f:
            async for piece in self.iter_range(key):
                await f.write(piece)
                n += len(piece)
        return n

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        return sorted(await self._list_impl(prefix), key=lambda o: o.key)

    async def upload(self, src: str | os.PathLike[str], key: str) -> int:
        """Store the local file ``src`` as ``key`` (multipart above a size threshold)."""
        return await self._upload_impl(os.fspath(src), _check_key(key, self.url))

    async def delete(self, key: str) -> None:
        """Delete ``key``. Deleting a missing key is not an error."""
        await self._delete_impl(_check_key(key, self.url))

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op for most backends
        """Release sessions and connections. Idempotent."""

    # -- what a backend implements ---------------------------------------------------
    async def _receive_into_impl(self, key: str, start: int, end: int, sink: Sink) -> None:
        """The default: :meth:`iter_range`'s pieces, written one by one."""
        pieces = self._iter_range_impl(key, start, end).__aiter__()
        try:
            async for piece in pieces:
                if not sink.write(piece):
                    break
        finally:
            sink.closing()
            with contextlib.suppress(Exception):  # best-effort cleanup of a failed stream
                await asyncio.wait_for(pieces.aclose(), ACLOSE_S)  # type: ignore[attr-defined]

    @abc.abstractmethod
    async def _head_impl(self, key: str) -> ObjectInfo: ...

    @abc.abstractmethod
    def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]: ...

    @abc.abstractmethod
    async def _list_impl(self, prefix: str) -> builtins.list[ObjectInfo]: ...

    @abc.abstractmethod
    async def _upload_impl(self, src: str, key: str) -> int: ...

    @abc.abstractmethod
    async def _delete_impl(self, key: str) -> None: ...


def _check_key(key: str, url: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"invalid object key {key!r} under {url}")
    return key
