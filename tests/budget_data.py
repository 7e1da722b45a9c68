"""A small remote dataset and GET counting for the cache-budget tests."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asynccache.config import Settings
from asynccache.format import Index
from asynccache.testing.faults import RequestRecord
from asynccache.write.upload import upload
from asynccache.write.writer import ChunkWriter, merge_dir

ITEM_BYTES = 1000
CHUNK_BYTES = 16 << 10


@dataclass(frozen=True)
class Remote:
    url: str
    index: Index

    @property
    def total(self) -> int:
        return sum(c.bytes for c in self.index.chunks)

    @property
    def chunk_names(self) -> list[str]:
        return [c.filename for c in self.index.chunks]


def write_remote(objstore: Any, directory: str, bucket: str, items: int) -> Remote:
    """``items`` dict items of about 1 KB, in chunks of at most 16 KiB, uploaded to S3."""
    w = ChunkWriter(directory, 0, chunk_bytes=CHUNK_BYTES)
    rng = np.random.default_rng(0)
    for i in range(items):
        w.add(i, {"i": i, "x": rng.integers(0, 255, ITEM_BYTES, dtype=np.uint8)})
    w.finish()
    index = merge_dir(directory, [0])
    objstore.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    upload(directory, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    return Remote(url, index)


def chunk_gets(requests: Iterable[RequestRecord]) -> collections.Counter[str]:
    """GETs per chunk file name (ranged parts of one chunk count once per request)."""
    return collections.Counter(
        os.path.basename(r.path)
        for r in requests
        if r.method == "GET" and os.path.basename(r.path).startswith("chunk-")
    )


def fetched_bytes(gets: collections.Counter[str], remote: Remote) -> int:
    size = {c.filename: c.bytes for c in remote.index.chunks}
    return sum(size[name] * n for name, n in gets.items())
