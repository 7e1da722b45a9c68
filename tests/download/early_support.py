"""Child processes for the early-publish tests (importable by spawn and forkserver)."""

from __future__ import annotations

import os
from typing import Any

from asynccache.config import Settings
from asynccache.read.source import DatasetSource


def holds(fd: int, ino: int) -> None:
    """Exit 1 if descriptor ``fd`` is open here on inode ``ino``, else 0."""
    try:
        same = os.fstat(fd).st_ino == ino
    except OSError:
        same = False
    os._exit(1 if same else 0)


def acquire_first(url: str, settings: Settings, conn: Any) -> None:
    """Acquire chunk 0 through a source of its own; send what it found."""
    with DatasetSource(url, settings=settings) as src:
        path = src.acquire(0)
        try:
            with open(path, "rb") as f:
                data = f.read()
            conn.send((path, os.path.exists(path), data, src.stats.chunks_fetched))
        finally:
            src.release(0)
