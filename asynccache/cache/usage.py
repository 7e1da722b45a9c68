"""How many bytes the cache holds and how many it may hold: scan, ledger, free space.

* :func:`scan` walks only what the cache owns: the dataset directories that hold the
  marker (:data:`.layout.DATASET_MARKER`), and in them only chunk names and our temporary
  names. Nothing else under ``cache_dir`` is read, counted or removed.
* The *ledger* is a one-line record in ``<cache_dir>/.evict.lock``, read and written only
  by a holder of that file's exclusive flock: the bytes the cache holds as of the last
  full scan plus every reservation since. Reservations trust it for a bounded number of
  reservations and seconds, so a reservation does not rescan the whole cache. It is an
  estimate, never a source of truth: failures and deletions only make it too high (a
  reservation is recorded before its file is created), and a too-high estimate only
  triggers an earlier rescan. A crash therefore leaves nothing stale that matters.
* :func:`fs_room` is what the filesystem can still take, less a safety margin.

Layer: stdlib and :mod:`.layout`, :mod:`.eviction`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from .eviction import Entry
from .layout import is_chunk_name, is_chunk_temp_name, is_dataset_dir, temp_final_name

__all__ = [
    "MARGIN_MAX_BYTES",
    "RESCAN_AFTER_S",
    "RESCAN_EVERY",
    "Ledger",
    "fs_free",
    "fs_room",
    "margin",
    "present",
    "read_ledger",
    "scan",
    "subtract",
    "write_ledger",
]

RESCAN_EVERY = 64  # reservations trusted to the ledger between two full scans
RESCAN_AFTER_S = 60.0  # and seconds
MARGIN_MAX_BYTES = 64 << 20
_LEDGER_BYTES = 96
_LEDGER_TAG = b"asynccache-usage-v1"


def scan(
    cache_dir: str | os.PathLike[str], own_root: str | os.PathLike[str] | None = None
) -> tuple[int, list[Entry]]:
    """Bytes the cache holds under ``cache_dir`` and its published chunks, with mtimes.

    Looks only in ``own_root`` and in the direct subdirectories of ``cache_dir`` that
    hold the dataset marker; in them only at chunk names (counted and returned as
    entries) and at our temporary names of chunks (counted by their size: they are
    preallocated to the chunk's size). Symlinks are never followed.

    Returns:
        ``(used_bytes, entries)``.
    """
    used = 0
    entries: list[Entry] = []
    roots: list[str] = []
    if own_root is not None:
        roots.append(os.path.abspath(own_root))
    try:
        with os.scandir(cache_dir) as it:
            for d in it:
                if d.is_dir(follow_symlinks=False) and is_dataset_dir(d.path):
                    path = os.path.abspath(d.path)
                    if path not in roots:
                        roots.append(path)
    except FileNotFoundError:
        pass
    for root in roots:
        try:
            with os.scandir(root) as it:
                files = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for f in files:
            chunk = is_chunk_name(f.name)
            if not chunk and not is_chunk_temp_name(f.name):
                continue  # not ours: never counted, never removed
            try:
                if not f.is_file(follow_symlinks=False):
                    continue
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if chunk:
                used += st.st_size
                entries.append(Entry(f.path, st.st_size, st.st_mtime))
            else:
                # Preallocated to the chunk's size: counted as the chunk will be once
                # published, so a full budget holds exactly its chunks' bytes.
                used += st.st_size
    return used, entries


def present(root: str | os.PathLike[str]) -> set[str]:
    """The chunk names in one dataset directory: published, or being downloaded."""
    names: set[str] = set()
    try:
        with os.scandir(root) as it:
            for f in it:
                if is_chunk_name(f.name):
                    names.add(f.name)
                elif is_chunk_temp_name(f.name):
                    names.add(temp_final_name(f.name))
    except (FileNotFoundError, NotADirectoryError):
        pass
    return names


def margin(fs_bytes: int) -> int:
    """Space left free on the cache's filesystem: 1% of it, at most 64 MiB."""
    return min(fs_bytes // 100, MARGIN_MAX_BYTES)


def fs_free(directory: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer can still allocate on ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def fs_room(directory: str | os.PathLike[str]) -> int:
    """Free bytes on ``directory``'s filesystem less :func:`margin` (may be negative)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize - margin(st.f_blocks * st.f_frsize)


@dataclasses.dataclass(frozen=True)
class Ledger:
    """The shared estimate of the cache's bytes (see the module docstring).

    Attributes:
        used: bytes held at the last full scan plus every reservation since.
        reservations: reservations recorded since that scan.
        scanned_at: wall-clock time of that scan (shared by processes on the node).
    """

    used: int
    reservations: int
    scanned_at: float

    def trusted(self, now: float) -> bool:
        """Young enough to skip a full scan."""
        return (
            self.reservations < RESCAN_EVERY
            and self.scanned_at - 1.0 <= now < self.scanned_at + RESCAN_AFTER_S
        )


def read_ledger(fd: int) -> Ledger | None:
    """The ledger in the lock file ``fd``, or None when absent or unreadable."""
    try:
        raw = os.pread(fd, _LEDGER_BYTES, 0)
    except OSError:
        return None
    fields = raw.split()
    if len(fields) != 4 or fields[0] != _LEDGER_TAG:
        return None
    try:
        ledger = Ledger(int(fields[1]), int(fields[2]), float(fields[3]))
    except ValueError:
        return None
    return ledger if ledger.used >= 0 and ledger.reservations >= 0 else None


def write_ledger(fd: int, used: int, reservations: int, scanned_at: float | None = None) -> None:
    """Record the ledger in the lock file ``fd`` (the caller holds its exclusive flock).

    Fixed width, written in place: a concurrent unlocked reader sees the old or the new
    record, or at worst an unreadable one, which it treats as "unknown".
    """
    at = time.time() if scanned_at is None else scanned_at
    line = b"%s %d %d %.3f" % (_LEDGER_TAG, max(used, 0), reservations, at)
    # A read-only or full disk: the next reservation scans instead.
    with contextlib.suppress(OSError):
        os.pwrite(fd, line.ljust(_LEDGER_BYTES - 1) + b"\n", 0)


def subtract(fd: int, nbytes: int) -> None:
    """Take ``nbytes`` the cache no longer holds (a reserved file removed unused) off the
    ledger in the lock file ``fd`` (the caller holds its exclusive flock). Only bytes of a
    file that was counted (reserved, or seen by a scan since) and removed by the caller may
    be taken off, so the ledger stays an over-estimate."""
    ledger = read_ledger(fd)
    if ledger is not None:
        write_ledger(fd, ledger.used - nbytes, ledger.reservations, ledger.scanned_at)
