"""``upload``: copy a written dataset directory to any storage URL.

Invariant: ``index.json`` is uploaded last and only after every other file succeeded, so
a reader that finds ``index.json`` at the destination finds every chunk it names. A
re-run skips files already present with the same size (``index.json`` is always
re-sent, being the commit). Hidden files and ``*.tmp`` (unfinished writes) are skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .bridge import get_loop_thread
from .config import Settings
from .errors import ConfigError
from .format import INDEX_NAME
from .storage import Storage, open_storage
from .storage.transport import gather_or_cancel

__all__ = ["UploadSummary", "upload", "upload_async"]

_MAX_PARALLEL_FILES = 8
# Outer bound on one sync ``upload`` call. Every request inside already has its own
# timeout and retry budget, so the call ends on its own; this bound only guards against
# a wedged loop. It is not derived from the settings because a healthy upload of a large
# dataset legitimately takes hours (about 80 TB at 1 GB/s fits in a day). If it is ever
# reached the upload is cancelled before ``index.json``, and a re-run skips what was sent.
_UPLOAD_BOUND_S = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class UploadSummary:
    """What one ``upload`` call did.

    Attributes:
        objects: files sent in this call (including ``index.json``).
        bytes: bytes sent in this call.
        seconds: wall time of the call.
        skipped: files already present with the same size, not sent again.
    """

    objects: int
    bytes: int
    seconds: float
    skipped: int


def upload(
    local_dir: str | os.PathLike[str],
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    settings: Settings | None = None,
) -> UploadSummary:
    """Upload every file of the dataset in ``local_dir`` to ``url``; ``index.json`` last.

    Runs on the process's I/O thread, so it also works when the caller is inside a
    running event loop (Jupyter).

    Args:
        local_dir: a directory written by the writer (holding ``index.json``).
        url: destination root (``s3://bucket/prefix``, a directory, ``file://``).
        storage_options: backend options (see docs/storage.md).
        settings: tuning; default ``Settings.from_env()``. ``progress=False`` (or
            ``ASYNCCACHE_PROGRESS=0``) hides the progress bar.

    Raises:
        ConfigError: ``local_dir`` is not a dataset directory, or a bad URL/option.
        StorageError: the destination refused a file (after which ``index.json`` is
            not uploaded, so the destination stays uncommitted).
        StorageTimeoutError: the whole call outlived its 24 h outer bound.
    """
    settings = settings if settings is not None else Settings.from_env()
    aws_env = Settings.aws_env()

    async def run() -> UploadSummary:
        storage = open_storage(url, settings, storage_options, aws_env)
        try:
            return await upload_async(storage, local_dir, settings=settings)
        finally:  # also on cancellation (bound reached, interpreter exit)
            await storage.close()

    return get_loop_thread().call(run(), _UPLOAD_BOUND_S)


async def upload_async(
    storage: Storage, local_dir: str | os.PathLike[str], *, settings: Settings
) -> UploadSummary:
    """Upload ``local_dir`` into ``storage`` (the async core of :func:`upload`)."""
    started = time.monotonic()
    root = Path(local_dir)
    files = await asyncio.to_thread(_dataset_files, root)
    remote = {o.key: o.size for o in await storage.list()}
    todo = [(k, s) for k, s in files if k == INDEX_NAME or remote.get(k) != s]
    skipped = len(files) - len(todo)
    chunks = [(k, s) for k, s in todo if k != INDEX_NAME]
    show = settings.progress and sys.stderr.isatty()
    gate = asyncio.Semaphore(max(1, min(_MAX_PARALLEL_FILES, settings.max_concurrency)))
    sent = 0
    with tqdm(
        total=sum(s for _, s in todo),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"upload {storage.url}",
        disable=not show,
    ) as bar:

        async def put(key: str) -> None:
            nonlocal sent
            async with gate:
                n = await storage.upload(root / key, key)
            sent += n
            bar.update(n)

        await gather_or_cancel(put(k) for k, _ in chunks)
        await put(INDEX_NAME)  # the commit: only after every chunk is stored
    return UploadSummary(
        objects=len(todo), bytes=sent, seconds=time.monotonic() - started, skipped=skipped
    )


def _dataset_files(root: Path) -> list[tuple[str, int]]:
    """``(key, size)`` of every dataset file under ``root``, sorted; index must exist."""
    if not (root / INDEX_NAME).is_file():
        raise ConfigError(
            f"{root} is not a dataset directory: no {INDEX_NAME} (write or merge the dataset first)"
        )
    out = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in names:
            if name.startswith(".") or name.endswith(".tmp"):
                continue
            path = Path(dirpath) / name
            out.append((path.relative_to(root).as_posix(), path.stat().st_size))
    return sorted(out)
