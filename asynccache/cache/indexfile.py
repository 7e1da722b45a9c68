"""Reading and writing ``index.json`` and its column sidecar (index version 2).

A version-2 index is two files: the sidecar ``index-<hex>.cols`` (written first) and the
small ``index.json`` that names it (the commit). Readers map the sidecar read-only, so
every process of a node shares its pages; a mapped :class:`~asynccache.format.Index`
pickles as the sidecar's path and is mapped again where it is unpickled (a spawned
worker), and a forked child inherits the mapping.

A mapped index holds a shared ``flock`` on the sidecar for as long as it lives: the cache's
evictor removes only what it can lock exclusively, so a cached sidecar stays while any
process has it mapped.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from typing import Any

from ..bridge import forksafe
from ..errors import BadIndexError, ObjectNotFoundError
from ..format import INDEX_NAME, Index
from ..format.columns import NAME_RE
from ..format.index import IndexMeta, load
from ..storage.base import Storage
from .fsutil import atomic_write, fsync_dir
from .locks import try_lock

__all__ = ["discard", "map_sidecar", "read_dir", "read_path", "read_storage", "write_dir"]


def map_sidecar(meta: IndexMeta, path: str) -> Index:
    """The index of ``meta``, its columns mapped from ``path`` (read-only, shared).

    Raises:
        CorruptIndexError: the sidecar is truncated or damaged.
        BadIndexError: it is missing or disagrees with ``index.json`` (names ``path``).
    """
    try:
        fd = forksafe.open_fd(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise BadIndexError(
            f"{path}: the column sidecar that {meta.where} names is missing"
        ) from exc
    # The mapping's own descriptor (a duplicate of fd: the same open file) keeps the lock
    # for as long as the mapping lives; a refused sidecar is unlocked at once, so that a
    # damaged cached copy can be removed.
    locked = False
    try:
        locked = try_lock(fd, exclusive=False)
        size = os.fstat(fd).st_size
        buf: Any = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
        idx = meta.open(buf, path)
    except BaseException:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        raise
    finally:
        forksafe.close_fd(fd)
    object.__setattr__(idx, "_opener", (_reopen, (meta, path)))
    return idx


def discard(path: str) -> bool:
    """Remove a damaged cached sidecar unless a process has it mapped (its shared lock);
    True when removed. The next open fetches it again."""
    try:  # tracked: a child forked meanwhile must not keep the probe's lock
        fd = forksafe.open_fd(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not try_lock(fd, exclusive=True) or os.stat(path).st_ino != os.fstat(fd).st_ino:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        forksafe.close_fd(fd)


def _reopen(meta: IndexMeta, path: str) -> Index:
    return map_sidecar(meta, path)


def read_path(path: str) -> Index:
    """The index in file ``path`` (either version; a sidecar is mapped from beside it).

    Raises:
        FileNotFoundError: no ``path``.
        BadIndexError: invalid (names the file at fault).
    """
    with open(path, "rb") as f:
        got = load(f.read(), path)
    if isinstance(got, Index):
        return got
    return map_sidecar(got, os.path.join(os.path.dirname(path), got.sidecar))


def read_dir(directory: str) -> Index:
    """The index of the dataset in ``directory``.

    Raises:
        ObjectNotFoundError: no ``index.json`` there.
        BadIndexError: invalid (names the file at fault).
    """
    path = os.path.join(directory, INDEX_NAME)
    try:
        return read_path(path)
    except FileNotFoundError as exc:
        raise ObjectNotFoundError(
            f"{path}: no dataset here (index.json is missing)", url=path
        ) from exc


def write_dir(directory: str, index: Index, *, fsync: bool = True) -> Index:
    """Write ``index`` as version 2 into ``directory``: the sidecar, then ``index.json``.

    Returns the index as readers will see it (mapped). Each file is published by an
    atomic rename; with ``fsync`` each is durable (and the directory) before the next.
    """
    name, data, text = index.to_columns()
    side = os.path.join(directory, name)
    atomic_write(side, [data], fsync=fsync)
    if fsync:
        fsync_dir(directory)
    path = os.path.join(directory, INDEX_NAME)
    atomic_write(path, [text.encode()], fsync=fsync)
    if fsync:
        fsync_dir(directory)
    got = load(text, path)
    assert isinstance(got, IndexMeta)
    out = map_sidecar(got, side)
    # Sidecars of earlier commits in this directory: no index names them any more (a
    # reader that mapped one keeps its pages).
    for old in sidecar_names(os.listdir(directory), name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, old))
    return out


async def read_storage(storage: Storage, key: str = INDEX_NAME) -> Index | None:
    """The index stored as ``key`` (either version; a sidecar is read into memory), or
    None when absent. For writers and tools; readers map it through the cache instead.

    Raises:
        CorruptIndexError, BadIndexError: invalid (names the object at fault).
    """
    try:
        data = await storage.read(key)
    except ObjectNotFoundError:
        return None
    got = load(data, storage.object_url(key))
    if isinstance(got, Index):
        return got
    prefix = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    try:
        side = await storage.read(prefix + got.sidecar)
    except ObjectNotFoundError as exc:
        raise BadIndexError(
            f"{storage.object_url(prefix + got.sidecar)}: the column sidecar that "
            f"{got.where} names is missing"
        ) from exc
    return got.open(side, storage.object_url(prefix + got.sidecar))


def sidecar_names(directory_names: list[str], keep: str | None) -> list[str]:
    """Sidecars among ``directory_names`` other than ``keep`` (left over by rewrites)."""
    return [n for n in directory_names if NAME_RE.match(n) and n != keep]
