"""S3 multipart upload: create, upload parts with bounded concurrency, complete.

Invariant: an upload either completes or is aborted (best effort), so a failed run does
not leave invisible parts accruing storage cost; the object appears only on completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from ..errors import StorageError
from .s3_wire import NS, file_body, parse_xml
from .transport import gather_or_cancel

if TYPE_CHECKING:
    from .s3 import S3Storage

__all__ = ["upload_multipart"]


async def upload_multipart(storage: S3Storage, src: str, key: str, size: int) -> None:
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
