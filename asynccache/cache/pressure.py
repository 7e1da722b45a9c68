"""A full disk: the node-wide mark that holds prefetching back, and what holds the disk.

When a reservation a reader waits for finds the disk full even after evicting, the store
(:meth:`.store.ChunkStore.reserve`) first frees what was taken only ahead of need, and
tells the other processes of the node to do the same:

* :func:`press` marks the cache under pressure: ``<cache_dir>/.pressure``, whose mtime is
  the last time a reader found the disk full. While the mark is younger than
  :data:`PRESSURE_S` (:func:`pressed`), every process's store makes no temporary file
  ahead of a download and releases those it made, and defers every prefetch
  (:class:`.plan.Deferred`: the downloader starts none until its reader asks for a
  chunk, or a moment passes); so the prefetch depth drops to what the readers ask for.
  It is a hint: a missing or unreadable mark reads as "no pressure", and the mark of a
  process that died expires with its age.
* :func:`holding` says what holds the disk meanwhile (published chunks, pinned here or
  elsewhere, downloads in flight, bytes that are not the cache's), whether waiting may
  free anything (another process's download or pin), and whether anything moved since
  the last look. The reader's reservation retries while something may be freed and
  the cache moves, bounded; then :class:`~asynccache.errors.DiskFullError` says what
  held the disk (:func:`full_error`).

Layer: stdlib, :mod:`.layout`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Collection

from ..errors import DiskFullError
from .layout import is_chunk_name, is_dataset_dir, is_temp_name

__all__ = ["PRESSURE_MARK", "PRESSURE_S", "Holding", "full_error", "holding", "press", "pressed"]

PRESSURE_MARK = ".pressure"
#: Prefetching stays held back this long after a reader last found the disk full.
PRESSURE_S = 2.0


def press(cache_dir: str | os.PathLike[str]) -> None:
    """Mark the cache under pressure now (never raises: a hint)."""
    path = os.path.join(cache_dir, PRESSURE_MARK)
    with contextlib.suppress(OSError):
        try:
            os.utime(path)
        except FileNotFoundError:
            # An empty file: no data block, so it can be made on a full disk.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))


def pressed(cache_dir: str | os.PathLike[str]) -> bool:
    """The cache was marked under pressure less than :data:`PRESSURE_S` ago."""
    try:
        at = os.stat(os.path.join(cache_dir, PRESSURE_MARK)).st_mtime
    except OSError:
        return False
    return -1.0 <= time.time() - at < PRESSURE_S


@dataclasses.dataclass(frozen=True)
class Holding:
    """What holds the cache's file system when a reservation finds it full.

    Attributes:
        free: bytes an unprivileged writer may still allocate.
        total: the file system's size.
        chunks: bytes of published chunks (every dataset of the cache).
        pinned_here: of those, bytes of chunks this process pins.
        downloading: bytes of temporary files being written (downloads, files made
            ahead of one), any process.
        may_free: waiting may free something: a download in flight (it publishes a chunk
            that can then be evicted), or a chunk pinned by another process (which
            unpins it when its reader moves on).
        state: what changes when anything in the cache moves (names, sizes, writes,
            free bytes): two equal states mean nothing moved in between.
    """

    free: int
    total: int
    chunks: int
    pinned_here: int
    downloading: int
    may_free: bool
    state: tuple[object, ...]

    @property
    def not_cache(self) -> int:
        """Bytes in use on the file system that are not the cache's files: other files,
        and chunks removed from the cache while a reader still maps them."""
        return max(self.total - self.free - self.chunks - self.downloading, 0)


def holding(
    cache_dir: str | os.PathLike[str],
    own_root: str | os.PathLike[str],
    pinned_here: Collection[str],
) -> Holding:
    """What holds the disk of ``cache_dir`` now; ``pinned_here``: the paths of the chunks
    this process pins (``own_root`` is its dataset directory)."""
    roots = [os.path.abspath(own_root)]
    with contextlib.suppress(OSError), os.scandir(cache_dir) as it:
        for d in it:
            path = os.path.abspath(d.path)
            if d.is_dir(follow_symlinks=False) and path not in roots and is_dataset_dir(path):
                roots.append(path)
    pins = {os.path.abspath(p) for p in pinned_here}
    chunks = pinned = downloading = 0
    elsewhere = False
    seen: list[tuple[str, int, int]] = []
    for root in roots:
        try:
            with os.scandir(root) as it:
                files = list(it)
        except OSError:
            continue
        for f in files:
            temp = is_temp_name(f.name)
            if not temp and not is_chunk_name(f.name):
                continue
            try:
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue
            seen.append((f.path, st.st_size, st.st_mtime_ns))
            if temp:
                held = st.st_blocks * 512
                downloading += held
                elsewhere = elsewhere or held > 0  # allocated: written, or made ahead
            else:
                chunks += st.st_size
                if os.path.abspath(f.path) in pins:
                    pinned += st.st_size
                else:
                    elsewhere = True  # not evicted just now: pinned by another process
    try:
        vfs = os.statvfs(cache_dir)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    except OSError:
        free = total = 0
    state = (free, tuple(sorted(seen)))
    return Holding(free, total, chunks, pinned, downloading, elsewhere, state)


def full_error(directory: str | os.PathLike[str], size: int, held: Holding) -> DiskFullError:
    """The error of a reservation of ``size`` bytes that nothing could make room for,
    naming the cache dir and what holds its disk."""
    mib = 1 << 20
    return DiskFullError(
        f"the disk holding the cache dir {directory} is full: {size} more bytes "
        f"({size / mib:.1f} MiB) do not fit even after evicting every unpinned chunk and "
        f"dropping what was fetched ahead. Free: {held.free} bytes of {held.total}; "
        f"published chunks: {held.chunks} bytes ({held.pinned_here} pinned by this "
        f"process, the rest pinned by others); downloads in flight: {held.downloading} "
        f"bytes; other files (or chunks a reader still maps): {held.not_cache} bytes. "
        "Give the cache a larger file system (ASYNCCACHE_CACHE_DIR), or read with fewer "
        "workers or a smaller shuffle_window"
    )
