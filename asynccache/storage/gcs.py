"""Google Cloud Storage backend: ``gs://bucket/prefix``, over the JSON API.

Transport is our aiohttp session (one pooled session per backend); google-auth only
finds credentials and refreshes tokens (:mod:`.gcs_auth`). Reads are ``alt=media`` GETs
with ``Range`` (the downloader splits objects into parallel ranged parts); uploads are
single streamed media uploads; listing pages through ``objects.list``.

Invariants: object names are percent-encoded whole (``/`` included) in paths; the
``Authorization`` header is fetched just before each request (tokens expire) and goes to
the endpoint's origin only: a redirect elsewhere is followed without it
(:func:`.transport.send_following`); errors are mapped by :mod:`.errmap` (429/503 with
``Retry-After`` are throttling) and name the ``gs://`` URL of the object, never a token.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from multidict import CIMultiDictProxy

from ..config import Settings
from ..errors import ObjectNotFoundError, StorageError
from .base import ObjectInfo, Storage
from .errmap import map_client_errors, status_error
from .gcs_auth import GcsAuth
from .s3_wire import file_body
from .transport import (
    SessionHolder,
    check_range,
    range_header,
    send_following,
    send_small,
    stream_response,
)

__all__ = ["GCS_ENDPOINT", "GcsStorage"]

GCS_ENDPOINT = "https://storage.googleapis.com"


class GcsStorage(Storage):
    """One ``gs://bucket[/prefix]`` root.

    Args:
        url: ``gs://bucket`` or ``gs://bucket/prefix``.
        bucket: the bucket. prefix: object-name prefix without slashes at either end.
        endpoint: ``scheme://host[:port]`` of the JSON API (an emulator's, or Google's).
        auth: credentials (:class:`GcsAuth`).
        settings: connection limit, timeouts, TLS default.
        verify: verify TLS certificates.
    """

    def __init__(
        self,
        url: str,
        *,
        bucket: str,
        prefix: str,
        endpoint: str,
        auth: GcsAuth,
        settings: Settings,
        verify: bool,
    ) -> None:
        self.url = url
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint.rstrip("/")
        self.auth = auth
        #: Objects per ``objects.list`` page (the service caps it at 1000).
        self.list_page_size = 1000
        self._sessions = SessionHolder(settings, verify=verify)

    def __repr__(self) -> str:
        return (
            f"GcsStorage({self.url!r}, endpoint={self.endpoint!r}, "
            f"credentials={self.auth.source!r}, verify={self._sessions.verify})"
        )

    @property
    def session_holder(self) -> SessionHolder:
        """The session owner (exposes ``verify`` and ``ssl_mode`` for inspection)."""
        return self._sessions

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _object_href(self, key: str, query: Mapping[str, str] | None = None) -> str:
        href = (
            f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}"
            f"/o/{quote(self._name(key), safe='')}"
        )
        return href + ("?" + urlencode(query, quote_via=quote) if query else "")

    async def _request(
        self,
        method: str,
        href: str,
        *,
        what: str,
        headers: Mapping[str, str] | None = None,
        data: Any = None,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[int, CIMultiDictProxy[str], bytes]:
        async with map_client_errors(what, method):
            return await send_small(
                self._sessions.get(),
                method,
                href,
                what=what,
                headers=headers or {},
                private=await self.auth.headers(),
                data=data,
                ok=ok,
                credential_source=self.auth.source,
            )

    def _json(self, body: bytes, what: str) -> dict[str, Any]:
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise StorageError(f"malformed JSON from {what}", url=what) from exc
        if not isinstance(doc, dict):
            raise StorageError(f"malformed JSON from {what}: not an object", url=what)
        return doc

    async def _head_impl(self, key: str) -> ObjectInfo:
        url = self.object_url(key)
        _, _, body = await self._request("GET", self._object_href(key), what=url)
        meta = self._json(body, url)
        try:
            size = int(meta["size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StorageError(f"GET {url}: metadata without a size", url=url) from exc
        return ObjectInfo(key=key, size=size, etag=meta.get("etag") or meta.get("md5Hash"))

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        url = self.object_url(key)
        check_range(start, end, url)
        if end is not None and end == start:
            return
        headers = {"Accept-Encoding": "identity"}
        rng = range_header(start, end)
        if rng:
            headers["Range"] = rng
        href = self._object_href(key, {"alt": "media"})
        async with map_client_errors(url):
            resp = await send_following(
                self._sessions.get(),
                "GET",
                href,
                headers=headers,
                what=url,
                private=await self.auth.headers(),
            )
        if resp.status == 416 and "/" not in resp.headers.get("Content-Range", ""):
            # A 416 without the object's size (emulators): past the end is an empty read.
            resp.release()
            if start >= (await self._head_impl(key)).size:
                return
            raise status_error(416, url, credential_source=self.auth.source)
        async for piece in stream_response(
            resp, url, start, end, credential_source=self.auth.source
        ):
            yield piece

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        full = self._name(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: list[ObjectInfo] = []
        token: str | None = None
        base = f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        while True:
            query = {"prefix": full, "maxResults": str(self.list_page_size)}
            if token:
                query["pageToken"] = token
            _, _, body = await self._request(
                "GET", base + "?" + urlencode(query, quote_via=quote), what=self.url
            )
            doc = self._json(body, self.url)
            for item in doc.get("items") or []:
                name = str(item.get("name", ""))
                size = int(item.get("size", 0))
                if name.endswith("/") and size == 0:
                    continue  # folder placeholder some tools create
                out.append(ObjectInfo(key=name[strip:], size=size, etag=item.get("etag")))
            token = doc.get("nextPageToken")
            if not token:
                return out

    async def _upload_impl(self, src: str, key: str) -> int:
        url = self.object_url(key)
        try:
            size = await asyncio.to_thread(os.path.getsize, src)
        except OSError as exc:
            raise ObjectNotFoundError(f"cannot upload {src}: {exc.strerror}", url=url) from exc
        query = {"uploadType": "media", "name": self._name(key)}
        href = f"{self.endpoint}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o?" + urlencode(
            query, quote_via=quote
        )
        await self._request(
            "POST",
            href,
            what=url,
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            data=file_body(src, 0, size),
        )
        return size

    async def _delete_impl(self, key: str) -> None:
        url = self.object_url(key)
        await self._request("DELETE", self._object_href(key), what=url, ok=(200, 204, 404))

    async def close(self) -> None:
        await self._sessions.close()
