"""Where cached files live, how they are published atomically, and how orphans are swept.

Layout::

    <cache_dir>/
      .evict.lock                       serialises eviction across processes
      <dataset id>/                     one per (source URL, index checksum)
        chunk-0-0.bin                   published chunks: complete and verified
        .chunk-0-1.bin.<pid>.<rand>.tmp a download in progress (its writer holds a flock)
        .locks/chunk-0-1.bin.lock       the chunk's download lock (flock, empty file)

A published name is only ever created by ``os.replace`` of a complete, verified, fsynced
temporary file, so a reader never sees a partial chunk, even after a crash.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
from pathlib import Path

from ..errors import CacheError
from .locks import try_lock

__all__ = [
    "LOCK_DIR",
    "TempFile",
    "dataset_dir",
    "fsync_dir",
    "is_temp_name",
    "sweep_orphans",
]

LOCK_DIR = ".locks"
_TMP_SUFFIX = ".tmp"


def dataset_dir(cache_dir: str | os.PathLike[str], source_url: str, index_checksum: str) -> Path:
    """The cache directory of one dataset identity.

    The name hashes the source URL together with the index checksum, so a dataset
    rewritten at the same URL gets a new directory and never serves stale chunks.
    """
    digest = hashlib.sha256(f"{source_url}\n{index_checksum}".encode()).hexdigest()[:32]
    return Path(cache_dir) / digest


def is_temp_name(name: str) -> bool:
    """True for names written by :class:`TempFile` (``.<name>.<pid>.<rand>.tmp``)."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX)


def cache_error(exc: OSError, directory: str | os.PathLike[str]) -> CacheError:
    """Translate a local OSError (disk full, permissions) into a CacheError naming the dir."""
    if exc.errno == errno.ENOSPC:
        return CacheError(f"no space left on the device holding the cache dir {directory}")
    return CacheError(f"cache dir {directory}: {exc.strerror or exc}")


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TempFile:
    """A preallocated temporary file next to its final name, locked while it is written.

    Invariants:
        * While this object is open its writer holds a flock on the file, so a sweeper
          that can lock a temporary file exclusively knows its writer is dead.
        * :meth:`publish` makes the final name appear complete or not at all
          (fsync, then ``os.replace``, then fsync of the directory).
        * After :meth:`publish` or :meth:`discard` the descriptor is closed.
    """

    def __init__(self, final: Path, size: int, *, durable: bool = True) -> None:
        self.final = final
        self.size = size
        self.durable = durable
        directory = final.parent
        for _ in range(3):
            name = f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
            self.path = directory / name
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise cache_error(exc, directory) from exc
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A sweeper may have taken the file between open and flock: make sure the
            # name still points at our inode, otherwise start again with a new name.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise CacheError(f"cannot create a temporary file in {directory}")
        self.fd: int | None = fd
        try:
            if size > 0:
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            self.discard()
            raise cache_error(exc, directory) from exc

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        """Write ``data`` at ``offset`` (parts of one chunk are written in place, any order)."""
        assert self.fd is not None
        try:
            while data:
                n = os.pwrite(self.fd, data, offset)
                data, offset = memoryview(data)[n:], offset + n
        except OSError as exc:
            raise cache_error(exc, self.final.parent) from exc

    def publish(self) -> None:
        """Flush the file and rename it to its final name, atomically."""
        assert self.fd is not None
        try:
            os.ftruncate(self.fd, self.size)
            if self.durable:
                os.fsync(self.fd)
            # Downgrade rather than drop the lock: the file stays "alive" for sweepers, and
            # once renamed it is held shared (like a pin) until the descriptor closes.
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            os.replace(self.path, self.final)
            if self.durable:
                fsync_dir(self.final.parent)
        except OSError as exc:
            self.discard()
            raise cache_error(exc, self.final.parent) from exc
        finally:
            self._close()

    def discard(self) -> None:
        """Remove the temporary file. Idempotent."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            self._close()

    def _close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def sweep_orphans(directory: str | os.PathLike[str]) -> list[str]:
    """Delete temporary files whose writer is gone (nobody holds their flock).

    Returns the names removed. A file a live writer is using is never removed: its lock
    makes the exclusive, non-blocking flock fail here.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not is_temp_name(entry.name):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            if try_lock(fd, exclusive=True) and os.stat(entry.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed
