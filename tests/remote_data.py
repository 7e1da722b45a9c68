"""Writing small datasets for the read-side tests, locally or into a bucket."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from asynccache.config import Settings
from asynccache.write.upload import upload
from asynccache.write.writer import ChunkWriter, merge_dir


def item(i: int) -> dict[str, Any]:
    """Item ``i``: recognisable by its ``"i"`` and ``"name"``."""
    return {"i": i, "name": f"item-{i}", "pad": b"x" * 64}


def write_dataset(
    directory: str | os.PathLike[str], n: int, chunk_size: int, pad: int = 64
) -> Path:
    """Write items ``0..n-1`` in chunks of ``chunk_size`` items; returns the directory."""
    directory = Path(directory)
    w = ChunkWriter(str(directory), 0, chunk_size=chunk_size)
    for i in range(n):
        w.add(i, dict(item(i), pad=b"x" * pad))
    w.finish()
    merge_dir(str(directory), [0])
    return directory


def upload_dataset(src: str | os.PathLike[str], url: str, storage_options: dict) -> str:
    upload(src, url, storage_options, settings=Settings.from_env(progress=False))
    return url
