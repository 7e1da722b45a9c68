"""Reading and writing ``index.json`` and its column sidecar (index version 2).

A version-2 index is two files: the sidecar ``index-<hex>.cols`` (written first) and the
small ``index.json`` that names it (the commit). Readers map the sidecar read-only, so
every process of a node shares its pages; a mapped :class:`~asynccache.format.Index`
pickles as the sidecar's path and is mapped again where it is unpickled (a spawned
worker), and a forked child inherits the mapping. Where the path is gone when unpickled
(the cache directory deleted after the index was mapped), the copy maps the same file
through the descriptor the pickling process keeps of it.

A mapped index holds a shared ``flock`` on the sidecar for as long as it lives: the cache's
evictor removes only what it can lock exclusively, so a cached sidecar stays while any
process has it mapped.

Sizes are bounded before anything is read whole: ``index.json`` by
``ASYNCCACHE_MAX_INDEX_BYTES`` (a body past it is cut off after that many bytes, never
read to its end), a sidecar by what the chunk and item counts of the ``index.json`` that
names it allow (:func:`~asynccache.format.columns.max_size`).

Fetched bytes are judged by :func:`load_fetched`: bytes whose own ``index_checksum``
vouches for them are what the writer wrote, and an error in them is the index's own;
bytes that fail it, or carry no intact one and are refused, may have been damaged on the
way and raise :class:`CorruptIndexError`, which a reader treats as transient.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from ..bridge import forksafe
from ..config import DEFAULT_MAX_INDEX_BYTES
from ..errors import BadIndexError, CorruptIndexError, ObjectNotFoundError
from ..format import INDEX_NAME, ChunkEntry, Index
from ..format.columns import NAME_RE, max_size
from ..format.index import IndexMeta, load, verify_sealed_bytes
from ..storage.base import Storage
from .fsutil import atomic_write, fsync_dir
from .layout import check_chunk_names
from .locks import try_lock

__all__ = [
    "check_sidecar_size",
    "discard",
    "load_fetched",
    "map_sidecar",
    "read_bounded",
    "read_dir",
    "read_path",
    "read_storage",
    "refusal_of",
    "too_large",
    "write_dir",
]

_SETTING = "ASYNCCACHE_MAX_INDEX_BYTES"

_PROC_SELF_FD = "/proc/self/fd"


def map_sidecar(meta: IndexMeta, path: str, *, reach: str | None = None) -> Index:
    """The index of ``meta``, its columns mapped from ``path`` (read-only, shared).

    A descriptor of the sidecar stays open for as long as the index lives (the mapping's
    own), so that a copy of the index unpickled in another process maps the same file
    even where ``path`` no longer reaches it (the cache directory deleted meanwhile):
    see :func:`_reopen`.

    Args:
        meta: the ``index.json`` that names the sidecar.
        path: the sidecar's path (messages name it; a copy unpickled elsewhere looks there
            first).
        reach: a path that opens the sidecar where ``path`` no longer does (another
            process's descriptor of it); default ``path``.

    Raises:
        CorruptIndexError: the sidecar is truncated or damaged.
        BadIndexError: it is missing or disagrees with ``index.json`` (names ``path``).
    """
    try:
        fd = forksafe.open_fd(reach or path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise _missing(meta, path) from exc
    # The descriptor (kept) and the mapping's own (a duplicate: the same open file) keep
    # the lock for as long as the index lives; a refused sidecar is unlocked at once, so
    # that a damaged cached copy can be removed.
    locked = False
    try:
        locked = try_lock(fd, exclusive=False)
        st = os.fstat(fd)
        before = _fds_on((st.st_dev, st.st_ino))
        buf: Any = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) if st.st_size else b""
        idx = meta.open(buf, path)
        check_chunk_names(idx, meta.where)
    except BaseException:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)  # (the mapping's duplicate may outlive this)
        forksafe.close_fd(fd)
        raise
    key = (st.st_dev, st.st_ino)
    # CPython's mapping keeps a duplicate of the descriptor for as long as it lives (the
    # index's life): that one is named to other processes, this one closed. Where it
    # cannot be told apart, this one is kept instead, and closed with the index.
    kept = _mapping_fd(key, before) if st.st_size else None
    pid = os.getpid()
    if kept is None:
        kept = fd
        closer = weakref.finalize(idx, _close, fd, pid)
        closer.atexit = False
    else:
        forksafe.close_fd(fd)
    object.__setattr__(idx, "_opener", (_reopen, (meta, path, pid, kept, key)))
    return idx


def _fds_on(key: tuple[int, int]) -> set[int] | None:
    """This process's descriptors open on the file ``key`` (device, inode), or None
    where that cannot be told (no ``/proc``)."""
    try:
        names = os.listdir(_PROC_SELF_FD)
    except OSError:
        return None
    out = set()
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            st = os.fstat(int(name))
            if (st.st_dev, st.st_ino) == key:
                out.add(int(name))
    return out


def _mapping_fd(key: tuple[int, int], before: set[int] | None) -> int | None:
    """The one descriptor on the file ``key`` opened since ``before`` (the descriptors
    on it then): the mapping's duplicate. None where there is not exactly one."""
    after = _fds_on(key)
    if before is None or after is None or len(after - before) != 1:
        return None
    return next(iter(after - before))


def _missing(meta: IndexMeta, path: str) -> BadIndexError:
    return BadIndexError(f"{path}: the column sidecar that {meta.where} names is missing")


def _close(fd: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child closed its copy at the fork already
        forksafe.close_fd(fd)


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


def _reopen(meta: IndexMeta, path: str, pid: int, fd: int, key: tuple[int, int]) -> Index:
    """A mapped index as unpickled (a spawned DataLoader worker): mapped from ``path``;
    where ``path`` is gone (the cache directory deleted since), from the descriptor
    ``fd`` of the process ``pid`` that mapped it (Linux ``/proc/<pid>/fd``), if that still
    reaches the same file (``key``: its device and inode). Where nothing reaches it, an
    index that raises :class:`BadIndexError` naming ``path`` when used: the worker then
    reports it as its exception, where failing here would end the worker unexplained."""
    try:
        return map_sidecar(meta, path)
    except BadIndexError:
        if os.path.exists(path):
            raise  # there, and not what index.json says: not a deletion
    other = f"/proc/{pid}/fd/{fd}"
    try:
        st = os.stat(other)
    except OSError:
        st = None
    if st is not None and (st.st_dev, st.st_ino) == key:
        with contextlib.suppress(FileNotFoundError, BadIndexError):
            return map_sidecar(meta, path, reach=other)
    out = Index(_Unreachable(_missing(meta, path)), dict(meta.config), meta.writer, meta.token)
    object.__setattr__(out, "_opener", (_reopen, (meta, path, pid, fd, key)))
    return out


class _Unreachable(Sequence[ChunkEntry]):
    """The chunks of an index whose sidecar nothing reaches: every use raises ``error``."""

    def __init__(self, error: BadIndexError) -> None:
        self.error = error

    def __len__(self) -> int:
        raise self.error

    def __getitem__(self, i: Any) -> Any:
        raise self.error

    def __iter__(self) -> Iterator[ChunkEntry]:
        raise self.error


def read_path(path: str, *, max_bytes: int = DEFAULT_MAX_INDEX_BYTES) -> Index:
    """The index in file ``path`` (either version; a sidecar is mapped from beside it).

    Raises:
        FileNotFoundError: no ``path``.
        BadIndexError: invalid, or larger than ``max_bytes`` (names the file at fault).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise too_large(path, size, max_bytes)
        got = load(f.read(max_bytes + 1), path)
    if isinstance(got, Index):
        check_chunk_names(got, path)
        return got
    side = os.path.join(os.path.dirname(path), got.sidecar)
    check_sidecar_size(got, side)
    return map_sidecar(got, side)


def read_dir(directory: str, *, max_bytes: int = DEFAULT_MAX_INDEX_BYTES) -> Index:
    """The index of the dataset in ``directory``.

    Raises:
        ObjectNotFoundError: no ``index.json`` there.
        BadIndexError: invalid (names the file at fault).
    """
    path = os.path.join(directory, INDEX_NAME)
    try:
        return read_path(path, max_bytes=max_bytes)
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


async def read_storage(
    storage: Storage, key: str = INDEX_NAME, *, max_bytes: int = DEFAULT_MAX_INDEX_BYTES
) -> Index | None:
    """The index stored as ``key`` (either version; a sidecar is read into memory), or
    None when absent. For writers and tools; readers map it through the cache instead.

    Raises:
        CorruptIndexError, BadIndexError: invalid, or larger than ``max_bytes`` (a
            sidecar: than its index allows); names the object at fault.
    """
    try:
        data = await read_bounded(storage, key, max_bytes)
    except ObjectNotFoundError:
        return None
    got = load_fetched(data, storage.object_url(key))
    if isinstance(got, Index):
        return got
    prefix = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    check_sidecar_size(got, storage.object_url(prefix + got.sidecar))
    try:
        # One byte more than the index records: a longer object is refused by open().
        side = await storage.read(prefix + got.sidecar, 0, got.sidecar_bytes + 1)
    except ObjectNotFoundError as exc:
        raise BadIndexError(
            f"{storage.object_url(prefix + got.sidecar)}: the column sidecar that "
            f"{got.where} names is missing"
        ) from exc
    return got.open(side, storage.object_url(prefix + got.sidecar))


def sidecar_names(directory_names: list[str], keep: str | None) -> list[str]:
    """Sidecars among ``directory_names`` other than ``keep`` (left over by rewrites)."""
    return [n for n in directory_names if NAME_RE.match(n) and n != keep]


async def read_bounded(storage: Storage, key: str, max_bytes: int) -> bytes:
    """The whole of ``key``, refusing an object of more than ``max_bytes`` bytes.

    The request asks for at most ``max_bytes + 1`` bytes (a ``Range``), and no more than
    that is read even from a server that ignores it: the connection is closed there, not
    drained. Only then is the object's size asked for (a HEAD), for the message.

    Raises:
        BadIndexError: larger than ``max_bytes`` (names the URL, the size and
            ``ASYNCCACHE_MAX_INDEX_BYTES``). Not transient: fetching again won't help.
        StorageError: as :meth:`.Storage.read`.
    """
    data = await storage.read(key, 0, max_bytes + 1)
    if len(data) <= max_bytes:
        return data
    del data
    size: int | None = None
    with contextlib.suppress(Exception):  # the size only makes the message better
        size = (await storage.head(key)).size
    raise too_large(storage.object_url(key), size, max_bytes)


def too_large(where: str, size: int | None, max_bytes: int) -> BadIndexError:
    """The error for an ``index.json`` of ``size`` bytes (None: unknown, more than the
    bound) past the bound ``max_bytes``."""
    what = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return BadIndexError(
        f"{where}: {what}, larger than the {max_bytes} bytes an index.json may have "
        f"(not read: set {_SETTING} higher if this index is meant to be that large)"
    )


def check_sidecar_size(meta: IndexMeta, where: str) -> None:
    """Refuse a sidecar size no index of ``meta``'s chunk and item counts can have,
    before anything is fetched or mapped (``where``: the sidecar, for the message).

    Raises:
        BadIndexError: ``meta.sidecar_bytes`` is past that bound.
    """
    fields = None if meta.parts is None else len(meta.parts) - 1
    most = max_size(meta.chunks, meta.total_items, fields)
    if meta.sidecar_bytes > most:
        raise BadIndexError(
            f"{where}: {meta.where} records a sidecar of {meta.sidecar_bytes} bytes, but "
            f"one of {meta.chunks} chunks and {meta.total_items} items has at most {most}"
        )


def load_fetched(data: bytes, where: str) -> Index | IndexMeta:
    """:func:`~asynccache.format.index.load` for bytes that came over a network, with
    damage on the way told apart from a bad index.

    The bytes are checked against their own ``index_checksum`` before they are parsed.
    When it vouches for them, any error is the index's own (BadIndexError and its
    subclasses, as :func:`load` raises them). Otherwise (it does not match, or there is
    no intact one and the bytes are refused) the error is a :class:`CorruptIndexError`,
    which readers fetch again: damage that breaks the JSON, or the checksum line itself,
    is then retried like any other. A refusal of unvouched bytes keeps what ``load``
    raised as ``refusal`` (:func:`refusal_of`), for the error that ends the retries.
    """
    vouched = verify_sealed_bytes(data, where)
    try:
        return load(data, where)
    except CorruptIndexError:
        raise
    except BadIndexError as exc:
        if vouched:
            raise
        err = CorruptIndexError(
            f"{exc} (its bytes carry no intact index_checksum: maybe damaged on the way)"
        )
        err.refusal = exc  # type: ignore[attr-defined]
        raise err from exc


def refusal_of(exc: BaseException) -> BadIndexError | None:
    """What :func:`load` said of unvouched bytes :func:`load_fetched` refused, if so."""
    got = getattr(exc, "refusal", None)
    return got if isinstance(got, BadIndexError) else None
