"""Read-only plain HTTP(S) backend: ``https://host/path/to/dataset``.

Objects are fetched with GET (``Range`` for parts) and sized with HEAD. HTTP has no
listing, upload or delete; those raise :class:`StorageError` naming the URL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import quote

from ..config import Settings
from ..errors import StorageError
from .base import ObjectInfo, Storage
from .errmap import map_client_errors, status_error
from .transport import (
    SessionHolder,
    check_range,
    encoded_url,
    range_header,
    stream_response,
)

__all__ = ["HttpStorage"]


class HttpStorage(Storage):
    """A dataset served by any HTTP server that honours ``Range`` and ``HEAD``.

    Args:
        url: root URL (``http://`` or ``https://``), without credentials.
        settings: timeouts, connection limit and the TLS default.
        verify: verify the server's TLS certificate (default on).
    """

    def __init__(self, url: str, settings: Settings, *, verify: bool = True) -> None:
        self.url = url
        self._sessions = SessionHolder(settings, verify=verify)

    def __repr__(self) -> str:
        return f"HttpStorage({self.url!r}, verify={self._sessions.verify})"

    @property
    def verify(self) -> bool:
        """Whether TLS certificates are verified."""
        return self._sessions.verify

    def _href(self, key: str) -> str:
        return self.url.rstrip("/") + "/" + quote(key, safe="/~")

    async def _head_impl(self, key: str) -> ObjectInfo:
        url = self.object_url(key)
        async with map_client_errors(url, "HEAD"):
            session = self._sessions.get()
            async with session.head(encoded_url(self._href(key)), allow_redirects=True) as resp:
                if resp.status != 200:
                    raise status_error(resp.status, url, headers=resp.headers, method="HEAD")
                size = resp.content_length
                etag = resp.headers.get("ETag")
        if size is None:
            raise StorageError(f"HEAD {url}: server sent no Content-Length", url=url)
        return ObjectInfo(key=key, size=size, etag=etag)

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        url = self.object_url(key)
        check_range(start, end, url)
        if end is not None and end == start:
            return
        headers = {"Accept-Encoding": "identity"}
        rng = range_header(start, end)
        if rng:
            headers["Range"] = rng
        async with map_client_errors(url):
            session = self._sessions.get()
            resp = await session.get(encoded_url(self._href(key)), headers=headers)
        async for piece in stream_response(resp, url, start, end):
            yield piece

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        raise StorageError(
            f"listing is not supported over plain HTTP ({self.url}); "
            "read the dataset's index.json instead",
            url=self.url,
        )

    async def _upload_impl(self, src: str, key: str) -> int:
        raise StorageError(
            f"{self.url} is read-only: upload to s3:// or a local directory instead",
            url=self.object_url(key),
        )

    async def _delete_impl(self, key: str) -> None:
        raise StorageError(f"{self.url} is read-only: cannot delete", url=self.object_url(key))

    async def close(self) -> None:
        await self._sessions.close()
