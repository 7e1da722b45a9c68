"""S3-compatible backend: ``s3://bucket/prefix`` on AWS or any endpoint (SeaweedFS, MinIO).

Transport is aiohttp (one pooled session per backend); botocore only signs (SigV4) and
resolves credentials. Invariants: path-style URLs for custom endpoints; every request
is signed just before it is sent (credentials may rotate); payloads are sent
``UNSIGNED-PAYLOAD`` so bodies stream from disk; secrets never reach a message.

Redirects: one to the same origin (scheme, host, port) is signed again for its URL and
followed; one to another origin is refused with a :class:`StorageError` naming both,
unless the requests are anonymous (then there is nothing to withhold, and it is
followed). Not followed without credentials either: a SigV4 request is valid for the
host it was signed for, so S3 at another host answers a bare one 403 and the real cause
(a region or endpoint mismatch, a misbehaving proxy) would be lost; and not signed for
the other host, which would hand it the signature and the session token
(``X-Amz-Security-Token``). aiohttp's own redirects kept that token (it drops only
``Authorization``), so none are left to it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

from ..config import Settings
from ..errors import ObjectNotFoundError, StorageError
from .base import UPLOAD_PART_BYTES, UPLOAD_THRESHOLD_BYTES, ObjectInfo, Sink, Storage
from .errmap import map_client_errors
from .s3_auth import S3Signer
from .s3_multipart import upload_multipart
from .s3_wire import NS, S3Response, file_body, parse_xml
from .transport import (
    SessionHolder,
    check_range,
    range_header,
    receive_ranged,
    send_following,
    send_small,
    stream_response,
)

__all__ = ["S3Storage"]

_MIN_PART = 5 << 20


class S3Storage(Storage):
    """One ``s3://bucket/prefix`` root.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``.
        bucket: the bucket name. prefix: key prefix without slashes at either end.
        endpoint: scheme://host[:port] of the service.
        path_style: ``endpoint/bucket/key`` (True) or ``bucket.endpoint/key``.
        signer: credentials and SigV4 signing.
        settings: connection limit, timeouts, TLS default.
        verify: verify TLS certificates.
        multipart_threshold: files at least this big are uploaded in parts.
        part_size: size of each part (at least 5 MiB).
    """

    def __init__(
        self,
        url: str,
        *,
        bucket: str,
        prefix: str,
        endpoint: str,
        path_style: bool,
        signer: S3Signer,
        settings: Settings,
        verify: bool,
        multipart_threshold: int = UPLOAD_THRESHOLD_BYTES,
        part_size: int = UPLOAD_PART_BYTES,
    ) -> None:
        self.url = url
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint.rstrip("/")
        self.path_style = path_style
        self.signer = signer
        self.multipart_threshold = multipart_threshold
        self.part_size = max(part_size, _MIN_PART)
        self.upload_concurrency = max(1, min(4, settings.max_concurrency))
        #: Keys per ListObjectsV2 page (the service may cap it, usually at 1000).
        self.list_page_size = 1000
        self._sessions = SessionHolder(settings, verify=verify)

    def __repr__(self) -> str:
        return (
            f"S3Storage({self.url!r}, endpoint={self.endpoint!r}, "
            f"credentials={self.signer.source!r}, verify={self._sessions.verify})"
        )

    # -- addressing ------------------------------------------------------------------
    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _bucket_url(self) -> str:
        if self.path_style:
            return f"{self.endpoint}/{quote(self.bucket, safe='')}"
        scheme, host = self.endpoint.split("://", 1)
        return f"{scheme}://{self.bucket}.{host}"

    def href(self, key: str | None, query: Mapping[str, str] | None = None) -> str:
        """The encoded request URL for ``key`` under the root (None: the bucket)."""
        url = self._bucket_url() + "/"
        if key is not None:
            url += quote(self._full_key(key), safe="/~")
        if query:
            url += "?" + "&".join(
                f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
            )
        return url

    # -- requests --------------------------------------------------------------------
    async def request(
        self,
        method: str,
        key: str | None,
        *,
        what: str,
        query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        data: Any = None,
        ok: tuple[int, ...] = (200,),
    ) -> S3Response:
        """Send one signed request and read its (small) body; raise mapped errors.

        ``what`` is the URL named in messages.
        """
        href = self.href(key, query)
        async with map_client_errors(what, method):
            status, hdrs, body = await send_small(
                self._sessions.get(),
                method,
                href,
                what=what,
                headers=headers or {},
                sign=self.signer.sign,
                refuse_foreign=not self.signer.anonymous,
                data=data,
                ok=ok,
                credential_source=self.signer.source,
            )
            return S3Response(status, hdrs, body)

    async def _head_impl(self, key: str) -> ObjectInfo:
        resp = await self.request("HEAD", key, what=self.object_url(key))
        size = resp.headers.get("Content-Length")
        if size is None:
            raise StorageError(
                f"HEAD {self.object_url(key)}: no Content-Length", url=self.object_url(key)
            )
        return ObjectInfo(key=key, size=int(size), etag=resp.headers.get("ETag"))

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        url = self.object_url(key)
        check_range(start, end, url)
        if end is not None and end == start:
            return
        headers = {}
        rng = range_header(start, end)
        if rng:
            headers["Range"] = rng
        async with map_client_errors(url):
            resp = await send_following(
                self._sessions.get(),
                "GET",
                self.href(key),
                headers=headers,
                what=url,
                sign=self.signer.sign,
                refuse_foreign=not self.signer.anonymous,
            )
        async for piece in stream_response(
            resp, url, start, end, credential_source=self.signer.source
        ):
            yield piece

    async def _receive_into_impl(self, key: str, start: int, end: int, sink: Sink) -> None:
        await receive_ranged(
            self, self._sessions, key, start, end, sink, self._direct_request, self.signer.source
        )

    async def _direct_request(self, key: str, rng: str) -> tuple[str, dict[str, str]]:
        href = self.href(key)
        async with map_client_errors(self.object_url(key)):
            return href, await self.signer.sign("GET", href, {"Range": rng})

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: list[ObjectInfo] = []
        token: str | None = None
        while True:
            query = {"list-type": "2", "prefix": full, "max-keys": str(self.list_page_size)}
            if token:
                query["continuation-token"] = token
            resp = await self.request("GET", None, what=self.url, query=query)
            root = parse_xml(resp.body, self.url)
            for item in root.iter(f"{NS}Contents"):
                key = item.findtext(f"{NS}Key") or ""
                size = int(item.findtext(f"{NS}Size") or 0)
                if key.endswith("/") and size == 0:
                    continue  # directory marker some stores create
                out.append(ObjectInfo(key=key[strip:], size=size, etag=item.findtext(f"{NS}ETag")))
            token = root.findtext(f"{NS}NextContinuationToken")
            if root.findtext(f"{NS}IsTruncated") != "true" or not token:
                return out

    async def _upload_impl(self, src: str, key: str) -> int:
        try:
            size = await asyncio.to_thread(os.path.getsize, src)
        except OSError as exc:
            raise ObjectNotFoundError(
                f"cannot upload {src}: {exc.strerror}", url=self.object_url(key)
            ) from exc
        if size >= self.multipart_threshold:
            await upload_multipart(self, src, key, size)
            return size
        await self.request(
            "PUT",
            key,
            what=self.object_url(key),
            headers={"Content-Length": str(size)},
            data=file_body(src, 0, size),
        )
        return size

    async def _delete_impl(self, key: str) -> None:
        url = self.object_url(key)
        try:
            await self.request("DELETE", key, what=url, ok=(200, 204))
        except ObjectNotFoundError as exc:
            if "NoSuchBucket" in str(exc):
                raise
            return

    async def close(self) -> None:
        await self._sessions.close()

    @property
    def session_holder(self) -> SessionHolder:
        """The session owner (exposes ``verify`` and ``ssl_mode`` for inspection)."""
        return self._sessions
