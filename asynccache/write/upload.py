"""``upload``: copy a written dataset directory to any storage URL.

Invariants:

* ``index.json`` is uploaded last and only after every other file succeeded, so a reader
  that finds ``index.json`` at the destination finds every chunk it names.
* Whenever the destination holds an ``index.json`` written by ``upload``, every chunk it
  names holds exactly the bytes it records. So before a re-upload overwrites a chunk,
  the old ``index.json`` is deleted (the destination is uncommitted until the new one
  lands): an interrupted re-upload never leaves an index vouching for replaced bytes.
* A chunk is skipped only when it is provably there already: the destination's
  ``index.json`` (parsed and verified) records it with the same checksum and size as the
  local index, and the object has that size. Anything else (no remote index, a damaged
  one, no record, another checksum) is sent. ``index.json`` is always re-sent, being the
  commit; other files (per-writer indexes) carry no record and are always sent.

Hidden files and ``*.tmp`` (unfinished writes) are never uploaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..bridge import get_loop_thread
from ..cache import indexfile
from ..config import Settings
from ..errors import ConfigError, DataError, ObjectNotFoundError
from ..format import INDEX_NAME, Index
from ..format.columns import NAME_RE as SIDECAR_NAME
from ..storage import Storage, open_storage
from ..storage.transport import gather_or_cancel

__all__ = ["UploadSummary", "plan_upload", "upload", "upload_async"]

log = logging.getLogger(__name__)

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
        skipped: chunks the destination's ``index.json`` already records with the same
            checksum and size, not sent again.
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
    local_index = await asyncio.to_thread(_read_local_index, root)
    remote = {o.key: o.size for o in await storage.list()}
    remote_index = await _remote_index(storage) if INDEX_NAME in remote else None
    todo = plan_upload(files, local_index, remote_index, remote)
    skipped = len(files) - len(todo)
    chunks = [(k, s) for k, s in todo if k != INDEX_NAME]
    if INDEX_NAME in remote and any(k in remote for k, _ in chunks):
        # Uncommit before overwriting: the old index must never vouch for new bytes,
        # or a later upload (or reader) would trust chunks that changed under it.
        await storage.delete(INDEX_NAME)
    if skipped:
        log.info(
            "upload %s: %d chunks already there (same checksum), skipped", storage.url, skipped
        )
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


def plan_upload(
    files: list[tuple[str, int]],
    local: Index,
    remote_index: Index | None,
    remote_sizes: Mapping[str, int],
) -> list[tuple[str, int]]:
    """The ``(key, size)`` of ``files`` to send; the rest are provably at the destination.

    A chunk is skipped only when the local index and the destination's index record it
    with the same checksum and size and the destination's object has that size (the
    local file, too). ``index.json`` is always sent. Pure: no I/O.
    """
    if remote_index is None:
        return list(files)
    here = {c.filename: c for c in local.chunks}
    there = {c.filename: c for c in remote_index.chunks}
    todo = []
    for key, size in files:
        if SIDECAR_NAME.match(key) and remote_sizes.get(key) == size:
            continue  # named by its own checksum: the same name is the same bytes
        mine, theirs = here.get(key), there.get(key)
        same = (
            key != INDEX_NAME
            and mine is not None
            and theirs is not None
            and mine.checksum == theirs.checksum
            and mine.bytes == theirs.bytes == size == remote_sizes.get(key)
        )
        if not same:
            todo.append((key, size))
    return todo


def _read_local_index(root: Path) -> Index:
    return indexfile.read_dir(str(root))


async def _remote_index(storage: Storage) -> Index | None:
    """The destination's ``index.json`` if it can be trusted; None when absent or damaged."""
    url = storage.object_url(INDEX_NAME)
    try:
        return await indexfile.read_storage(storage)
    except ObjectNotFoundError:
        return None
    except DataError as exc:  # damaged or foreign: it proves nothing, so nothing is skipped
        log.warning("upload: ignoring %s (%s); every chunk is sent", url, exc)
        return None


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
