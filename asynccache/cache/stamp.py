"""Boot stamps: a durable cache without an fsync per chunk.

A published chunk must never be served with bytes it did not verify, even after a power
loss. An fsync before each publish guarantees that, at the price of the disk's write and
cache flush on every download's path. A chunk's pages, once written, are served from the
page cache until the machine goes down: within one boot, a chunk verified before its
publish is good whatever the disk holds. So a durable store on a file system that keeps
extended attributes marks each chunk, before its rename, with the id of the boot it was
verified in (Linux ``/proc/sys/kernel/random/boot_id``), and fsyncs nothing.

A reader trusts a published chunk whose stamp is this boot's, or :data:`SYNCED` (its
bytes are known to be on the disk). Any other chunk (stamped in an earlier boot, or not at
all: a store without stamps, an older release) is checked again before its first use
(:meth:`.ChunkStore.restamp`): its checksum recomputed from the file; if it matches, it is
stamped again (:data:`SYNCED` when it was stamped in an earlier boot, whose pages can only
come from the disk now), else it is fetched again. Every order in which a power loss may
write or lose the file's blocks, its inode (with the stamp) and its name ends in a chunk
either checked again or trusted for a reason that still holds.

Where the stamp cannot be written (no ``user`` extended attributes: some FUSE and
network file systems, older tmpfs; not Linux), the store fsyncs as before and marks the
chunk :data:`SYNCED` if it can.
"""

from __future__ import annotations

import errno
import functools
import os

__all__ = ["ATTR", "SYNCED", "boot_id", "mark", "probe", "read", "trusted"]

ATTR = "user.asynccache.boot"
SYNCED = b"synced"  # the bytes were fsynced, or read back from the disk, and matched
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# An attribute the file system refuses (unsupported, not permitted, no room for it).
_REFUSED = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.ENOSPC})


@functools.cache
def boot_id() -> bytes | None:
    """This boot's id (the same in every process until the machine restarts), or None
    where the system has none to read."""
    try:
        with open(_BOOT_ID, "rb") as f:
            value = f.read().strip()
    except OSError:
        return None
    return value or None


def probe(path: str | os.PathLike[str]) -> bytes | None:
    """This boot's id if stamps can be written on ``path``'s file system (a file the
    cache owns, stamped here to find out), else None."""
    boot = boot_id()
    if boot is None or not hasattr(os, "setxattr"):
        return None
    try:
        os.setxattr(path, ATTR, boot)
    except OSError:
        return None
    return boot


def mark(fd: int, value: bytes) -> bool:
    """Stamp the open file ``fd``; False where the file system refuses the attribute.

    Raises:
        OSError: any other failure (an I/O error).
    """
    if not hasattr(os, "setxattr"):
        return False
    try:
        os.setxattr(fd, ATTR, value)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return False
        raise
    return True


def read(target: int | str | os.PathLike[str]) -> bytes | None:
    """The stamp of a file (an open descriptor or a path), None when it has none.

    Raises:
        FileNotFoundError: ``target`` is a path with no file.
    """
    if not hasattr(os, "getxattr"):
        return None
    try:
        return os.getxattr(target, ATTR)
    except FileNotFoundError:
        raise
    except OSError:
        return None  # ENODATA: never stamped; a refusal: no stamp can be trusted either


def trusted(value: bytes | None, boot: bytes) -> bool:
    """A chunk with stamp ``value`` may be served in boot ``boot`` without a check."""
    return value is not None and value in (boot, SYNCED)
