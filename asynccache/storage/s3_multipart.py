"""S3 multipart upload: create, upload parts with bounded concurrency, complete.

Invariant: an upload either completes or is aborted (best effort), so a failed run does
not leave invisible parts accruing storage cost; the object appears only on completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any, Protocol

from ..errors import StorageError
from .s3_wire import NS, S3Response, file_body, parse_xml
from .transport import gather_or_cancel

__all__ = ["MultipartTarget", "upload_multipart"]


class MultipartTarget(Protocol):
    """What an upload in parts needs of its S3 backend (``S3Storage`` is one)."""

    part_size: int
    upload_concurrency: int

    def object_url(self, key: str) -> str: ...

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
    ) -> S3Response: ...


async def upload_multipart(storage: MultipartTarget, src: str, key: str, size: int) -> None:
    """Upload ``src`` (``size`` bytes) to ``key`` in ``storage.part_size`` parts."""
    url = storage.object_url(key)
    resp = await storage.request("POST", key, what=url, query={"uploads": ""})
    upload_id = parse_xml(resp.body, url).findtext(f"{NS}UploadId")
    if not upload_id:
        raise StorageError(f"CreateMultipartUpload for {url} returned no UploadId", url=url)
    part_size = storage.part_size
    offsets = list(range(0, size, part_size))
    etags: dict[int, str] = {}
    gate = asyncio.Semaphore(storage.upload_concurrency)

    async def put_part(number: int, offset: int) -> None:
        length = min(part_size, size - offset)
        async with gate:
            part = await storage.request(
                "PUT",
                key,
                what=url,
                query={"partNumber": str(number), "uploadId": upload_id},
                headers={"Content-Length": str(length)},
                data=file_body(src, offset, length),
            )
        etag = part.headers.get("ETag")
        if not etag:
            raise StorageError(f"UploadPart {number} of {url} returned no ETag", url=url)
        etags[number] = etag

    try:
        await gather_or_cancel(put_part(i + 1, off) for i, off in enumerate(offsets))
        root = ET.Element("CompleteMultipartUpload", xmlns=NS.strip("{}"))
        for number in sorted(etags):
            part_el = ET.SubElement(root, "Part")
            ET.SubElement(part_el, "PartNumber").text = str(number)
            ET.SubElement(part_el, "ETag").text = etags[number]
        body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
        done = await storage.request(
            "POST",
            key,
            what=url,
            query={"uploadId": upload_id},
            headers={"Content-Type": "application/xml"},
            data=body,
        )
        # S3 can answer 200 with an <Error> body when completion fails late.
        if b"<Error>" in done.body:
            raise StorageError(
                f"CompleteMultipartUpload for {url} failed: {done.body[:200]!r}", url=url
            )
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                storage.request(
                    "DELETE", key, what=url, query={"uploadId": upload_id}, ok=(200, 204, 404)
                ),
                timeout=10.0,
            )
        raise
