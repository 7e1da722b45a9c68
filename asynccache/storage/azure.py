"""Azure Blob Storage backend: ``az://container/prefix`` (also ``abfs[s]://``), REST API.

Transport is our aiohttp session; the Azure SDK only signs (SharedKey) and azure-identity
only mints tokens (:mod:`.azure_auth`). Reads are GETs with ``Range``; uploads are one
``Put Blob`` below ``multipart_threshold`` and parallel ``Put Block`` + ``Put Block
List`` above it (the blob appears only when the list is committed); listing pages
through ``List Blobs`` markers.

Invariants: every request carries ``x-ms-version`` and a fresh ``x-ms-date`` and is
signed just before it is sent, for its own URL (a redirect to the same origin is signed
again; one elsewhere is followed without ``Authorization``: the SharedKey signature or
bearer token never leaves the account's origin, see :func:`.transport.send_following`);
throttling (503 ``ServerBusy``, 429) is a ThrottledError and 500 ``OperationTimedOut`` a
TransientError, each carrying the delay from ``Retry-After`` or ``x-ms-retry-after-ms``;
messages name the ``az://`` URL, never a key, SAS or token.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import os
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

from ..config import Settings
from ..errors import ObjectNotFoundError, StorageError
from .azure_auth import AzureAuth
from .base import UPLOAD_PART_BYTES, UPLOAD_THRESHOLD_BYTES, ObjectInfo, Storage
from .errmap import map_client_errors, status_error
from .s3_wire import S3Response, file_body, parse_xml
from .transport import (
    SessionHolder,
    check_range,
    gather_or_cancel,
    range_header,
    send_following,
    send_small,
    stream_response,
)

__all__ = ["API_VERSION", "AzureStorage"]

#: The REST API version we speak (Azurite and every public region accept it).
API_VERSION = "2021-12-02"
_MAX_BLOCKS = 50_000


class AzureStorage(Storage):
    """One ``az://container[/prefix]`` root.

    Args:
        url: the root URL as shown in messages.
        container: the container. prefix: blob-name prefix without slashes at either end.
        endpoint: the account's blob endpoint (``https://acct.blob.core.windows.net`` or
            an emulator's ``http://127.0.0.1:10000/devstoreaccount1``).
        auth: credentials and signing.
        settings: connection limit, timeouts, TLS default.
        verify: verify TLS certificates.
        multipart_threshold: files at least this big are uploaded as blocks.
        part_size: block size.
    """

    def __init__(
        self,
        url: str,
        *,
        container: str,
        prefix: str,
        endpoint: str,
        auth: AzureAuth,
        settings: Settings,
        verify: bool,
        multipart_threshold: int = UPLOAD_THRESHOLD_BYTES,
        part_size: int = UPLOAD_PART_BYTES,
    ) -> None:
        self.url = url
        self.container = container
        self.prefix = prefix
        self.endpoint = endpoint.rstrip("/")
        self.auth = auth
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.upload_concurrency = max(1, min(4, settings.max_concurrency))
        #: Blobs per ``List Blobs`` page (the service caps it at 5000).
        self.list_page_size = 5000
        self._sessions = SessionHolder(settings, verify=verify)

    def __repr__(self) -> str:
        return (
            f"AzureStorage({self.url!r}, endpoint={self.endpoint!r}, "
            f"credentials={self.auth.source!r}, verify={self._sessions.verify})"
        )

    @property
    def session_holder(self) -> SessionHolder:
        """The session owner (exposes ``verify`` and ``ssl_mode`` for inspection)."""
        return self._sessions

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def href(self, key: str | None, query: Mapping[str, str] | None = None) -> str:
        """The encoded request URL of blob ``key`` (None: the container), SAS included."""
        url = f"{self.endpoint}/{quote(self.container, safe='')}"
        if key is not None:
            url += "/" + quote(self._name(key), safe="/~")
        full = self.auth.query(query or {})
        if full:
            url += "?" + "&".join(
                f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in full.items()
            )
        return url

    async def _signed(self, method: str, href: str, headers: Mapping[str, str]) -> dict[str, str]:
        hdrs = {
            "x-ms-version": API_VERSION,
            "x-ms-date": email.utils.formatdate(usegmt=True),
            **headers,
        }
        return await self.auth.sign(method, href, hdrs)

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
        """Send one signed request, read its (small) body, raise mapped errors."""
        href = self.href(key, query)
        hdrs = dict(headers or {})
        if data is not None and not any(k.lower() == "content-type" for k in hdrs):
            # aiohttp would add one after signing; SharedKey signs Content-Type.
            hdrs["Content-Type"] = "application/octet-stream"
        async with map_client_errors(what, method):
            status, rhdrs, body = await send_small(
                self._sessions.get(),
                method,
                href,
                what=what,
                headers=hdrs,
                sign=self._signed,
                data=data,
                ok=ok,
                credential_source=self.auth.source,
            )
            return S3Response(status, rhdrs, body)

    async def _head_impl(self, key: str) -> ObjectInfo:
        url = self.object_url(key)
        resp = await self.request("HEAD", key, what=url)
        size = resp.headers.get("Content-Length")
        if size is None:
            raise StorageError(f"HEAD {url}: no Content-Length", url=url)
        return ObjectInfo(key=key, size=int(size), etag=resp.headers.get("ETag"))

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        url = self.object_url(key)
        check_range(start, end, url)
        if end is not None and end == start:
            return
        headers: dict[str, str] = {}
        rng = range_header(start, end)
        if rng:
            headers["x-ms-range"] = rng  # signed by SharedKey; plain Range is not
        async with map_client_errors(url):
            resp = await send_following(
                self._sessions.get(),
                "GET",
                self.href(key),
                headers=headers,
                what=url,
                sign=self._signed,
            )
        if resp.status == 416 and "/" not in resp.headers.get("Content-Range", ""):
            resp.release()  # InvalidRange: past the end is an empty read, as elsewhere
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
        marker = ""
        while True:
            query = {
                "restype": "container",
                "comp": "list",
                "prefix": full,
                "maxresults": str(self.list_page_size),
            }
            if marker:
                query["marker"] = marker
            resp = await self.request("GET", None, what=self.url, query=query)
            root = parse_xml(resp.body, self.url)
            for blob in root.iter("Blob"):
                name = blob.findtext("Name") or ""
                props = blob.find("Properties")
                size = int((props.findtext("Content-Length") if props is not None else 0) or 0)
                etag = props.findtext("Etag") if props is not None else None
                if name.endswith("/") and size == 0:
                    continue  # directory marker some tools create
                out.append(ObjectInfo(key=name[strip:], size=size, etag=etag))
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return out

    async def _upload_impl(self, src: str, key: str) -> int:
        url = self.object_url(key)
        try:
            size = await asyncio.to_thread(os.path.getsize, src)
        except OSError as exc:
            raise ObjectNotFoundError(f"cannot upload {src}: {exc.strerror}", url=url) from exc
        if size >= self.multipart_threshold:
            await self._upload_blocks(src, key, size)
            return size
        await self.request(
            "PUT",
            key,
            what=url,
            headers={
                "x-ms-blob-type": "BlockBlob",
                "Content-Length": str(size),
                "Content-Type": "application/octet-stream",
            },
            data=file_body(src, 0, size),
            ok=(201,),
        )
        return size

    async def _upload_blocks(self, src: str, key: str, size: int) -> None:
        """Parallel ``Put Block``, then ``Put Block List``: all or nothing.

        Uncommitted blocks are garbage-collected by the service after a week; they are
        never visible as the blob.
        """
        url = self.object_url(key)
        part = max(self.part_size, -(-size // _MAX_BLOCKS))
        offsets = list(range(0, size, part))
        ids = [base64.b64encode(f"{i:08d}".encode()).decode() for i in range(len(offsets))]
        gate = asyncio.Semaphore(self.upload_concurrency)

        async def put_block(block_id: str, offset: int) -> None:
            length = min(part, size - offset)
            async with gate:
                await self.request(
                    "PUT",
                    key,
                    what=url,
                    query={"comp": "block", "blockid": block_id},
                    headers={"Content-Length": str(length)},
                    data=file_body(src, offset, length),
                    ok=(201,),
                )

        await gather_or_cancel(put_block(b, off) for b, off in zip(ids, offsets, strict=True))
        root = ET.Element("BlockList")
        for block_id in ids:
            ET.SubElement(root, "Latest").text = block_id
        body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
        await self.request(
            "PUT",
            key,
            what=url,
            query={"comp": "blocklist"},
            headers={"Content-Type": "application/xml", "Content-Length": str(len(body))},
            data=body,
            ok=(201,),
        )

    async def _delete_impl(self, key: str) -> None:
        url = self.object_url(key)
        try:
            await self.request("DELETE", key, what=url, ok=(200, 202, 204))
        except ObjectNotFoundError as exc:
            if "ContainerNotFound" in str(exc):
                raise

    async def close(self) -> None:
        await self._sessions.close()
        await self.auth.close()
