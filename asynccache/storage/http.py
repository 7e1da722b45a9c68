"""Read-only plain HTTP(S) backend: ``https://host/path/to/dataset``.

Objects are fetched with GET (``Range`` for parts) and sized with HEAD. HTTP has no
listing, upload or delete; those raise :class:`StorageError` naming the URL.

``headers`` (``storage_options={"headers": {...}}``: bearer tokens, cookies) are sent
to the dataset's origin only, never to a host a redirect leads to, and never appear in
a message, a log line or ``repr`` (only their names do).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from urllib.parse import quote

from ..config import Settings
from ..errors import StorageError
from .base import ObjectInfo, Sink, Storage
from .errmap import map_client_errors, status_error
from .transport import (
    SessionHolder,
    check_range,
    range_header,
    receive_ranged,
    send_following,
    stream_response,
)

__all__ = ["HttpStorage"]


class HttpStorage(Storage):
    """A dataset served by any HTTP server that honours ``Range`` and ``HEAD``.

    Args:
        url: root URL (``http://`` or ``https://``), without credentials.
        settings: timeouts, connection limit and the TLS default.
        verify: verify the server's TLS certificate (default on).
        headers: extra request headers for the dataset's origin (may hold secrets).
    """

    def __init__(
        self,
        url: str,
        settings: Settings,
        *,
        verify: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        self._sessions = SessionHolder(settings, verify=verify)
        self._headers = dict(headers or {})
        self._source = f"storage_options headers {sorted(self._headers)}" if self._headers else None

    def __repr__(self) -> str:
        names = f", headers={sorted(self._headers)}" if self._headers else ""
        return f"HttpStorage({self.url!r}, verify={self._sessions.verify}{names})"

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
            resp = await send_following(
                session, "HEAD", self._href(key), headers={}, private=self._headers, what=url
            )
            async with resp:
                if resp.status != 200:
                    raise status_error(
                        resp.status,
                        url,
                        headers=resp.headers,
                        method="HEAD",
                        credential_source=self._source,
                    )
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
            resp = await send_following(
                session, "GET", self._href(key), headers=headers, private=self._headers, what=url
            )
        async for piece in stream_response(resp, url, start, end, credential_source=self._source):
            yield piece

    async def _receive_into_impl(self, key: str, start: int, end: int, sink: Sink) -> None:
        await receive_ranged(
            self, self._sessions, key, start, end, sink, self._direct_request, self._source
        )

    async def _direct_request(self, key: str, rng: str) -> tuple[str, dict[str, str]]:
        # The dataset's own origin: its headers go along. A redirect is not followed
        # here: the request is sent again by _iter_range_impl (send_following), which
        # keeps them from other origins.
        headers = {"Accept-Encoding": "identity", "Range": rng}
        headers.update(self._headers)
        return self._href(key), headers

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
