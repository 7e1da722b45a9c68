"""Small S3 wire helpers shared by the S3 backend and its multipart upload."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator

import aiofiles
from multidict import CIMultiDictProxy

from ..errors import StorageError
from .errmap import error_code

__all__ = ["NS", "S3Response", "file_body", "parse_xml"]

#: XML namespace of S3 responses, in ElementTree's ``{uri}`` form.
NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_FILE_PIECE = 1 << 20


class S3Response:
    """Status, headers and (small) body of a completed S3 request."""

    def __init__(self, status: int, headers: CIMultiDictProxy[str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


async def file_body(path: str, offset: int, length: int) -> AsyncIterator[bytes]:
    """Stream ``length`` bytes of ``path`` from ``offset`` without blocking the loop."""
    async with aiofiles.open(path, "rb") as f:
        await f.seek(offset)
        remaining = length
        while remaining > 0:
            piece = await f.read(min(_FILE_PIECE, remaining))
            if not piece:
                raise StorageError(f"{path} shrank while uploading it")
            remaining -= len(piece)
            yield piece


def parse_xml(body: bytes, url: str) -> ET.Element:
    """Parse an S3 XML response; a malformed one is a StorageError naming ``url``."""
    try:
        return ET.fromstring(body)
    except ET.ParseError as exc:
        raise StorageError(f"malformed XML from {url}: {error_code(body) or exc}", url=url) from exc
