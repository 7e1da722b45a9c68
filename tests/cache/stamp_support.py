"""A child process for the boot stamp tests: reads a whole dataset through the cache."""

from __future__ import annotations

from typing import Any

import numpy as np

from asynccache.config import Settings
from asynccache.read.reader import Reader
from asynccache.read.source import DatasetSource
from tests.helpers import noise_item

_WAIT_S = 60.0


def read_everything(
    url: str, cache: str, items: int, per_chunk: int, item_bytes: int, go: Any, out: Any
) -> None:
    """Read every item (checking its bytes) once ``go`` is set; put the chunks this
    process checked again (``restamped``) on ``out``, or the error."""
    try:
        settings = Settings(
            cache_dir=cache,
            retries=1,
            timeout_s=10.0,
            prefetch_chunks=0,
            durable=True,
            first_read_bytes=0,
            progress=False,
        )
        with DatasetSource(url, settings=settings) as src:
            assert go.wait(_WAIT_S)  # the index is in: the chunks' checks are what is raced
            reader = Reader(src.index, src.acquire, release=src.release, ranged=None)
            try:
                for i in range(items):
                    got = reader.read(i // per_chunk, i % per_chunk)
                    want = noise_item(i, item_bytes)
                    assert got["i"] == i and np.array_equal(got["x"], want["x"]), i
            finally:
                reader.close()
            out.put(src.stats.restamped)
    except BaseException as exc:
        out.put(repr(exc))
