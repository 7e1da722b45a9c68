"""Small file-system helpers shared by the writer and the cache: atomic publish, durable names."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterable, Iterator

from ..errors import CacheError

TMP_SUFFIX = ".tmp"


def temp_name(path: str) -> str:
    """A unique hidden temp path beside ``path``: ``.<name>.<pid>.<random>.tmp``."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one file at a path from another put there later: device, inode, size,
    modification and change time (ns). A file checked once is trusted by this, not by
    its name."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the names renamed into ``directory`` durable (a power loss keeps them)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, pieces: Iterable[bytes | memoryview], *, fsync: bool = False) -> int:
    """Write ``pieces`` to a temp file beside ``path``, then rename it into place.

    A reader sees either no file or the whole file, never a part. Returns the byte count.

    Raises:
        CacheError: the disk is full or the directory is not writable (names ``path``).
    """
    tmp = temp_name(path)
    n = 0
    with publishing(tmp, path):
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
                n += len(piece) if isinstance(piece, bytes) else piece.nbytes
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    return n


@contextlib.contextmanager
def publishing(tmp: str, path: str) -> Iterator[None]:
    """Around writing ``tmp`` and renaming it to ``path``: on any failure ``tmp`` is
    removed (nothing half-written stays), and an ``OSError`` becomes a ``CacheError``
    naming ``path`` (a full disk said as such)."""
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            why = "the disk is full" if exc.errno == errno.ENOSPC else exc.strerror
            raise CacheError(f"cannot write {path}: {why}") from exc
        raise
