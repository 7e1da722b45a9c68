"""How many bytes the cache holds and how many it may hold: scan, ledger, free space.

* :func:`scan` walks only what the cache owns: the dataset directories that hold the
  marker (:data:`.layout.DATASET_MARKER`), and in them only chunk names (every chunk's
  :func:`.layout.local_name` is one) and our temporary names. Nothing else under
  ``cache_dir`` is read, counted or removed.
* The *ledger* is a one-line record in ``<cache_dir>/.evict.lock``, read and written only
  by a holder of that file's exclusive flock: the bytes the cache holds as of the last
  full scan plus every reservation since. Reservations trust it for a bounded number of
  reservations and seconds, so a reservation does not rescan the whole cache. It is an
  estimate, never a source of truth: failures and deletions only make it too high (a
  reservation is recorded before its file is created), and a too-high estimate only
  triggers an earlier rescan. A crash therefore leaves nothing stale that matters.
* The *pending reservations* follow the ledger's line in the same file: one entry per
  temporary file admitted under the lock and perhaps not preallocated yet (its path and
  size). A reservation creates its file (empty, locked by its writer) before it takes the
  lock, records the entry and the bytes under it, and preallocates after letting it go, so
  the slow file-system steps run outside the lock. Until the entry is settled a scan
  counts that file at the entry's size, not at what it holds now, and the room the
  filesystem has is taken as less by what is admitted and not allocated yet. Every holder
  of the lock settles the entries first (:func:`settle`): one whose file is gone is
  dropped (its bytes too, unless its chunk was published); one whose writer died (its
  file can be locked exclusively) is swept: the file removed, its bytes taken off.
* :func:`fs_room` is what the filesystem can still take, less a safety margin.

Layer: stdlib and :mod:`.layout`, :mod:`.eviction`, :mod:`.locks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import time
from collections.abc import Sequence
from typing import NamedTuple

from ..bridge import forksafe
from .eviction import Entry
from .layout import is_chunk_name, is_chunk_temp_name, is_dataset_dir, is_temp_name, temp_final_name
from .locks import try_lock

__all__ = [
    "MARGIN_MAX_BYTES",
    "RESCAN_AFTER_S",
    "RESCAN_EVERY",
    "Ledger",
    "Pending",
    "Scan",
    "Settled",
    "fs_capacity",
    "fs_free",
    "fs_room",
    "margin",
    "pending_of",
    "present",
    "read_ledger",
    "read_pending",
    "scan",
    "settle",
    "subtract",
    "write_ledger",
    "write_pending",
]

RESCAN_EVERY = 64  # reservations trusted to the ledger between two full scans
RESCAN_AFTER_S = 60.0  # and seconds
MARGIN_MAX_BYTES = 64 << 20
_LEDGER_BYTES = 96
_LEDGER_TAG = b"asynccache-usage-v1"
_PENDING_TAG = b"P"
_PENDING_READ = 1 << 16  # the entries' region read at once (a few hundred entries)


class Scan(NamedTuple):
    """What :func:`scan` found.

    Attributes:
        used: the bytes the cache holds.
        entries: its published chunks, with their mtimes.
        pending: the entries of the ``pending`` it was given whose temporary file it
            counted as one. The others were published before it looked (it counted the
            chunk, if still there) or removed: its total is the truth about them, and a
            ledger written from it must not keep them, or the next settle would take
            their bytes off a second time.
    """

    used: int
    entries: list[Entry]
    pending: list[Pending]


def scan(
    cache_dir: str | os.PathLike[str],
    own_root: str | os.PathLike[str] | None = None,
    pending: Sequence[Pending] = (),
) -> Scan:
    """Bytes the cache holds under ``cache_dir`` and its published chunks, with mtimes.

    Looks only in ``own_root`` and in the direct subdirectories of ``cache_dir`` that
    hold the dataset marker; in them only at chunk names (counted and returned as
    entries) and at our temporary names of chunks (counted by their size: they are
    preallocated to the chunk's size), except those in ``pending`` (admitted, perhaps not
    preallocated yet), counted at their admitted size. Symlinks are never followed.
    """
    used = 0
    entries: list[Entry] = []
    admitted = {(e.dev, e.ino): e.size for e in pending}
    counted: set[tuple[int, int]] = set()
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
        listed = {f.name for f in files}
        for f in files:
            chunk = is_chunk_name(f.name)
            if not chunk and not is_chunk_temp_name(f.name):
                continue  # not ours: never counted, never removed
            try:
                if not f.is_file(follow_symlinks=False):
                    continue
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                if chunk:
                    continue  # removed since the listing
                # Published since the listing (publishing takes no lock a scan holds):
                # the chunk it became, which the listing did not see, is counted.
                final = temp_final_name(f.name)
                if final in listed:
                    continue
                listed.add(final)
                path = os.path.join(root, final)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed unused
                if stat.S_ISREG(st.st_mode):
                    used += st.st_size
                    entries.append(Entry(path, st.st_size, st.st_mtime))
                continue
            if chunk:
                used += st.st_size
                entries.append(Entry(f.path, st.st_size, st.st_mtime))
            else:
                # Preallocated to the chunk's size: counted as the chunk will be once
                # published, so a full budget holds exactly its chunks' bytes.
                key = (st.st_dev, st.st_ino)
                counted.add(key)
                used += max(st.st_size, admitted.get(key, 0))
    return Scan(used, entries, [e for e in pending if (e.dev, e.ino) in counted])


def present(root: str | os.PathLike[str]) -> set[str]:
    """The chunks' local names (:func:`.layout.local_name`) in one dataset directory:
    published, or being downloaded."""
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


def fs_capacity(directory: str | os.PathLike[str]) -> int:
    """The most the cache could hold on ``directory``'s filesystem: its size less
    :func:`margin` (with nothing else on it)."""
    st = os.statvfs(directory)
    size = st.f_blocks * st.f_frsize
    return size - margin(size)


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


def write_ledger(
    fd: int,
    used: int,
    reservations: int,
    scanned_at: float | None = None,
    pending: list[Pending] | None = None,
) -> None:
    """Record the ledger in the lock file ``fd`` (the caller holds its exclusive flock),
    and the pending reservations when given, in the same write.

    Fixed width, written in place: a concurrent unlocked reader sees the old or the new
    record, or at worst an unreadable one, which it treats as "unknown".
    """
    at = time.time() if scanned_at is None else scanned_at
    line = b"%s %d %d %.3f" % (_LEDGER_TAG, max(used, 0), reservations, at)
    data = line.ljust(_LEDGER_BYTES - 1) + b"\n"
    # A read-only or full disk: the next reservation scans instead.
    with contextlib.suppress(OSError):
        if pending is not None:
            data += _pending_bytes(fd, pending)
        os.pwrite(fd, data, 0)


def subtract(fd: int, nbytes: int) -> None:
    """Take ``nbytes`` the cache no longer holds (a reserved file removed unused) off the
    ledger in the lock file ``fd`` (the caller holds its exclusive flock). Only bytes of a
    file that was counted (reserved, or seen by a scan since) and removed by the caller may
    be taken off, so the ledger stays an over-estimate."""
    ledger = read_ledger(fd)
    if ledger is not None:
        write_ledger(fd, ledger.used - nbytes, ledger.reservations, ledger.scanned_at)


@dataclasses.dataclass(frozen=True)
class Pending:
    """One pending reservation: a temporary file admitted under the lock.

    Attributes:
        path: the file's path relative to the cache directory (the lock file's), so that
            processes that reach the cache by different paths (other mounts) agree; an
            absolute path for a dataset directory outside it.
        size: the bytes admitted for it.
        dev: its device, and
        ino: its inode (a scan matches it by these, whatever spelling of the path it sees).
    """

    path: str
    size: int
    dev: int
    ino: int

    def resolve(self, base: str | os.PathLike[str]) -> str:
        """The file's path, the cache directory being ``base``."""
        return os.path.join(base, self.path)


def pending_of(path: str, fd: int, size: int, base: str | os.PathLike[str]) -> Pending:
    """The entry of the temporary file ``path``, open as ``fd``, admitted for ``size``,
    in the cache directory ``base``."""
    st = os.fstat(fd)
    full, top = os.path.abspath(path), os.path.abspath(base)
    rel = os.path.relpath(full, top)
    kept = full if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel
    return Pending(kept, size, st.st_dev, st.st_ino)


@dataclasses.dataclass(frozen=True)
class Settled:
    """The ledger and the pending reservations after :func:`settle`.

    Attributes:
        ledger: the ledger (None when absent or unreadable: the caller scans).
        pending: the live entries.
        unallocated: bytes admitted and not preallocated yet (what the filesystem's free
            space does not show taken yet).
    """

    ledger: Ledger | None
    pending: list[Pending]
    unallocated: int


def read_pending(fd: int) -> list[Pending]:
    """The pending reservations recorded in the lock file ``fd``."""
    try:
        raw = os.pread(fd, _PENDING_READ, _LEDGER_BYTES)
    except OSError:
        return []
    out: list[Pending] = []
    for line in raw.splitlines():
        fields = line.split(maxsplit=4)
        if len(fields) != 5 or fields[0] != _PENDING_TAG:
            continue  # padding, or a line cut by the read's bound
        try:
            path = json.loads(fields[4])
            size, dev, ino = int(fields[1]), int(fields[2]), int(fields[3])
        except ValueError:
            continue
        if isinstance(path, str) and size >= 0:
            out.append(Pending(path, size, dev, ino))
    return out


def write_pending(fd: int, entries: list[Pending]) -> None:
    """Record the pending reservations after the ledger's line in the lock file ``fd``
    (the caller holds its exclusive flock)."""
    with contextlib.suppress(OSError):
        body = _pending_bytes(fd, entries)
        if body:
            os.pwrite(fd, body, _LEDGER_BYTES)


def _pending_bytes(fd: int, entries: list[Pending]) -> bytes:
    """The entries' region as written in place: padded over what was there (never
    truncated: a truncate waits for the journal on ext4)."""
    body = b"".join(
        b"%s %d %d %d %s\n" % (_PENDING_TAG, e.size, e.dev, e.ino, json.dumps(e.path).encode())
        for e in entries
    )
    old = os.fstat(fd).st_size - _LEDGER_BYTES
    if len(body) < old:
        body += b" " * (old - len(body) - 1) + b"\n"
    return body


def settle(fd: int, base: str | os.PathLike[str]) -> Settled:
    """Settle the pending reservations in the lock file ``fd`` (held exclusively) of the
    cache directory ``base``.

    An entry whose file is gone is dropped: published (its chunk's name exists), its bytes
    stay counted, as the chunk's; otherwise (removed unused, or deleted underneath) its
    bytes are taken off the ledger. An entry whose file nobody holds locked belongs to a
    dead writer: the file is removed (swept) and its bytes taken off. A live one stays. A
    writer records its entry only after locking its file, so a live writer's file is
    always locked.
    """
    ledger = read_ledger(fd)
    entries = read_pending(fd)
    if not entries:
        return Settled(ledger, [], 0)
    live: list[Pending] = []
    dropped = 0
    unallocated = 0
    for e in entries:
        state, held = _pending_state(e.resolve(base), e)
        if state == "live":
            live.append(e)
            unallocated += max(e.size - held, 0)
        elif state == "gone":
            dropped += e.size
        # "published": counted as its chunk from now on
    if len(live) != len(entries):
        if ledger is not None:
            if dropped:
                ledger = Ledger(
                    max(ledger.used - dropped, 0), ledger.reservations, ledger.scanned_at
                )
            write_ledger(fd, ledger.used, ledger.reservations, ledger.scanned_at, live)
        else:
            write_pending(fd, live)
    return Settled(ledger, live, unallocated)


def _pending_state(path: str, e: Pending) -> tuple[str, int]:
    """``("live", bytes its file holds)``, ``("published", 0)`` or ``("gone", 0)`` (a dead
    writer's file is removed here)."""
    try:
        fd = forksafe.open_fd(path, os.O_RDONLY)
    except FileNotFoundError:
        return _gone_or_published(path, None), 0
    except OSError:
        return "live", 0  # cannot look: keep counting it (errs high)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (e.dev, e.ino):
            return "gone", 0  # another file under its name: its own was removed
        if try_lock(fd, exclusive=True):
            # Its writer let go: dead, or done since the open above (published or
            # removed; a writer holds its lock until then). Sweep it if dead.
            try:
                if os.stat(path).st_ino == st.st_ino:
                    os.unlink(path)
                    return "gone", 0
            except FileNotFoundError:
                pass
            return _gone_or_published(path, st), 0
        return "live", st.st_size
    except OSError:
        return "live", 0
    finally:
        forksafe.close_fd(fd)


def _gone_or_published(path: str, st: os.stat_result | None) -> str:
    """``"published"`` when the temporary file ``path``, gone, has its final name now
    (the same file, where ``st`` says which one it was), else ``"gone"``; ``"live"`` when
    the final name can't be looked at (kept counted: errs high, as for a file that can't
    be opened)."""
    head, tail = os.path.split(path)
    if not is_temp_name(tail):
        return "gone"
    try:
        final = os.stat(os.path.join(head, temp_final_name(tail)))
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "live"
    if st is not None and (final.st_dev, final.st_ino) != (st.st_dev, st.st_ino):
        return "gone"
    return "published"
