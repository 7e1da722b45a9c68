"""Where cached files live, how they are published atomically, and how orphans are swept.

Layout::

    <cache_dir>/
      .evict.lock                       serialises eviction; holds the usage ledger
      <dataset id>/                     one per (source URL, index checksum)
        chunk-0-0.bin                   published chunks: complete and verified
        chunk-~<32 hex>.bin             a chunk the index calls otherwise (local_name)
        index-<16 hex>.cols             a version-2 index's column sidecar (not counted)
        .chunk-0-1.bin.<pid>.<rand>.tmp a download in progress (its writer holds a flock)
        .locks/.asynccache-dataset      marker: this directory belongs to the cache
        .locks/chunk-0-1.bin.lock       the chunk's download lock (flock, empty file)

The files of a chunk are named after its *local name* (:func:`local_name`), not after the
index's name as such: a name of the writer's form (``chunk-<writer>-<n>.bin``, short, in
plain characters) keeps it, and any other (``data_0001.bin``, a name too long to take the
temporary suffix) becomes ``chunk-~<hash of the name>.bin``. So every chunk the cache writes
has a name the scan knows as its own (counted against the budget, evicted), whatever the
index calls it, and no other file in the directory is ever taken for one.

A published name is only ever created by ``os.replace`` of a complete, verified temporary
file, so a reader never sees a partial chunk, even after a crash. Across a power loss a
durable store relies on the file's boot stamp (:mod:`.stamp`: checked again in a later
boot) or, where the file system keeps no stamp, on an fsync before the rename.

The process that downloaded a chunk may read it before it is published (while the fsync
runs): its store holds a duplicate of the temporary file's descriptor and hands its own
readers :func:`reopen_path` of it, a name that reaches that inode whatever the rename does
(Linux ``/proc/self/fd``). Other processes see the chunk only under its published name.

The cache touches only what it created: directories holding the marker, and in them only
chunk names (:func:`is_chunk_name`: every chunk's local name is one) and our temporary
names (:func:`is_temp_name`).
Every descriptor that may carry a flock is tracked by :mod:`asynccache.bridge.forksafe`, so a
forked child never keeps a lock of its parent alive.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ..bridge import forksafe
from ..errors import BadIndexError, CacheError, DiskFullError
from ..format import Index
from ..format.columns import PatternNames, TableNames
from ..format.index import NAME_MAX
from . import stamp as stamps
from .fsutil import fsync_dir
from .locks import try_lock

__all__ = [
    "DATASET_MARKER",
    "LOCK_DIR",
    "NAME_MAX",
    "SIDECAR_RE",
    "TempFile",
    "check_chunk_names",
    "dataset_dir",
    "ensure_dataset_dir",
    "fsync_dir",
    "is_chunk_name",
    "is_dataset_dir",
    "is_temp_name",
    "local_name",
    "reopen_path",
    "reopens",
    "shown_path",
    "sweep_orphans",
    "temp_final_name",
]

LOCK_DIR = ".locks"
DATASET_MARKER = f"{LOCK_DIR}/.asynccache-dataset"
_TMP_SUFFIX = ".tmp"
# ``chunk-<writer>-<n>.bin`` as the writer names them; any ``chunk-*.bin`` is accepted.
_CHUNK_RE = re.compile(r"chunk-[^/]*\.bin")
# An index's column sidecar, fetched into the cache beside the chunks: the one file the
# cache keeps outside the budget (see local_name).
SIDECAR_RE = re.compile(r"index-[0-9a-f]{16}\.cols")
_SIDECAR_LEN = len("index-0123456789abcdef.cols")
# Index names kept as local names: the writer's forms, in plain characters (never ``~``,
# which marks a hashed name: a kept name never equals the hash of another).
_PLAIN_RE = re.compile(r"chunk-[A-Za-z0-9_.-]*\.bin")
_HASHED = "chunk-~{}.bin"
# A kept name this long still takes the temporary suffix (``.<name>.<pid>.<8 hex>.tmp``).
_PLAIN_MAX = 200
# ``.<final name>.<pid>.<8 hex>.tmp``, exactly what TempFile creates.
_TEMP_RE = re.compile(r"\.(?P<final>[^/]+)\.[0-9]+\.[0-9a-f]{8}\.tmp")
# Opening ``/proc/self/fd/N`` reopens the inode behind descriptor N (Linux): a name for a
# file that is being renamed, or was removed, for as long as N stays open.
_PROC_FD = "/proc/self/fd/"
_DELETED = " (deleted)"
_can_reopen: bool | None = None


def reopen_path(fd: int) -> str | None:
    """A path that opens the inode behind ``fd`` (of this process) while ``fd`` stays open,
    whatever happens to its names; None where the system has no such path (no ``/proc``)."""
    global _can_reopen
    if _can_reopen is None:
        _can_reopen = sys.platform.startswith("linux") and os.path.isdir(_PROC_FD)
    return f"{_PROC_FD}{fd}" if _can_reopen else None


def reopens(path: str) -> bool:
    """``path`` is a :func:`reopen_path`."""
    return path.startswith(_PROC_FD)


def shown_path(path: str) -> str:
    """The name to show for ``path`` in messages: for a :func:`reopen_path`, the chunk's
    published name (what the file is called, or will be once published); else ``path``."""
    if not reopens(path):
        return path
    try:
        target = os.readlink(path)
    except OSError:
        return path
    target = target.removesuffix(_DELETED)
    head, tail = os.path.split(target)
    m = _TEMP_RE.fullmatch(tail)
    return os.path.join(head, m["final"]) if m else target


def dataset_dir(cache_dir: str | os.PathLike[str], source_url: str, index_checksum: str) -> Path:
    """The cache directory of one dataset identity.

    The name hashes the source URL together with the index checksum, so a dataset
    rewritten at the same URL gets a new directory and never serves stale chunks.
    """
    digest = hashlib.sha256(f"{source_url}\n{index_checksum}".encode()).hexdigest()[:32]
    return Path(cache_dir) / digest


def local_name(name: str) -> str:
    """The file name chunk ``name`` (as the index names it) has in a dataset directory.

    ``name`` itself when it has the writer's form (``chunk-*.bin`` of letters, digits,
    ``_``, ``.``, ``-``, at most 200 bytes); otherwise ``chunk-~<32 hex>.bin``, from a
    hash of ``name``. Either way a chunk name (:func:`is_chunk_name`), so the cache counts
    and evicts the file; and two index names never share a local name (a kept name has no
    ``~``; hashed ones differ unless SHA-256 collides). Pure; cheap for kept names.

    The one exception is a version-2 index's column sidecar (``index-<16 hex>.cols``,
    fetched through the store like a chunk), which keeps its name and stays outside the
    budget: it is the index itself, mapped by every process reading the dataset for as
    long as it is open, a few bytes per chunk; it goes with its dataset directory. No
    chunk has such a name (:func:`check_chunk_names`).
    """
    if len(name) <= _PLAIN_MAX and _PLAIN_RE.fullmatch(name):
        return name
    if SIDECAR_RE.fullmatch(name):
        return name
    return _HASHED.format(hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32])


def check_chunk_names(index: Index, where: str) -> None:
    """Refuse an index with a chunk name no file system takes (longer than
    :data:`NAME_MAX` bytes, a path separator, ``.`` or ``..``, a NUL), or one of a
    column sidecar's form (``index-<16 hex>.cols``: the cache keeps such a file outside
    its budget, see :func:`local_name`). At open, so that a bad name is reported before
    an epoch starts, not when its chunk is reached.

    The names of a version-1 index are checked for the first as it is parsed
    (:func:`asynccache.format.index.check_filename`). A column sidecar's are checked
    without decoding each name: a pattern's longest name, the table's byte lengths.

    Raises:
        BadIndexError: names ``where`` (the index) and the chunk.
    """
    if not index.mapped:
        maybe: Iterable[int] = range(index.num_chunks)  # a version-1 index: small
    else:
        names = index.columns.names
        if isinstance(names, TableNames):
            lens = np.diff(names.start)
            if len(lens) and int(lens.max()) > NAME_MAX:
                c = int(np.argmax(lens))
                raise BadIndexError(_too_long(where, c, names.name(c)))
            maybe = np.flatnonzero(lens == _SIDECAR_LEN).tolist()
        elif isinstance(names, PatternNames):
            # The longest name: each number at its widest (the sidecar refuses a minus).
            longest = sum(len(p.encode()) for p in names.parts) + sum(
                len(str(int(f.max()))) if len(f) else 0 for f in names.fields
            )
            if longest > NAME_MAX:
                widest = [int(np.argmax(f)) for f in names.fields if len(f)]
                c = max(widest, key=lambda i: len(names.name(i).encode()), default=0)
                raise BadIndexError(_too_long(where, c, names.name(c)))
            sidecar_like = names.parts[0].startswith("index-") and names.parts[-1].endswith(".cols")
            maybe = range(index.num_chunks) if sidecar_like else ()
        else:
            maybe = ()
    for c in maybe:
        name = index.filename(c)
        if SIDECAR_RE.fullmatch(name):
            raise BadIndexError(
                f"{where}: chunk {c}: its file name {name!r} is a column sidecar's "
                "(index-<16 hex>.cols), which no chunk may take"
            )


def _too_long(where: str, chunk: int, name: str) -> str:
    size = len(name.encode("utf-8", "surrogatepass"))
    return (
        f"{where}: chunk {chunk}: its file name {name[:48]!r}... is {size} bytes, longer "
        f"than a file name may be ({NAME_MAX} bytes)"
    )


def is_temp_name(name: str) -> bool:
    """True for names written by :class:`TempFile` (``.<name>.<pid>.<rand>.tmp``)."""
    return _TEMP_RE.fullmatch(name) is not None


def is_chunk_name(name: str) -> bool:
    """True for the names the cache counts and evicts: ``chunk-*.bin`` (a chunk's
    :func:`local_name` is one, whatever the index calls it)."""
    return _CHUNK_RE.fullmatch(name) is not None


def is_chunk_temp_name(name: str) -> bool:
    """True for a :class:`TempFile` name whose final name is a chunk name."""
    m = _TEMP_RE.fullmatch(name)
    return m is not None and is_chunk_name(m["final"])


def temp_final_name(name: str) -> str:
    """The final name of a :class:`TempFile` name (``name`` must be one)."""
    m = _TEMP_RE.fullmatch(name)
    assert m is not None, name
    return m["final"]


def is_dataset_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory the cache created (it holds the marker file)."""
    return os.path.isfile(os.path.join(path, DATASET_MARKER))


def ensure_dataset_dir(root: str | os.PathLike[str]) -> None:
    """Create ``root`` (and its parents), its lock directory and its marker. Idempotent.

    Called when a store opens its directory and again whenever it finds the layout gone
    (``rm -rf`` of the cache underneath a running job): the cache is then rebuilt.

    Raises:
        CacheError: the directory cannot be created (names it).
    """
    try:
        os.makedirs(os.path.join(root, LOCK_DIR), exist_ok=True)
        marker = os.path.join(root, DATASET_MARKER)
        if not os.path.exists(marker):
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as exc:
        raise cache_error(exc, root) from exc


def cache_error(exc: OSError, directory: str | os.PathLike[str]) -> CacheError:
    """Translate a local OSError (disk full, permissions) into a CacheError naming the dir.

    A full disk becomes :class:`DiskFullError`.
    """
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left on the device holding the cache dir {directory}")
    return CacheError(f"cache dir {directory}: {exc.strerror or exc}")


class TempFile:
    """A preallocated temporary file next to its final name, locked while it is written.

    Invariants:
        * While this object is open its writer holds a flock on the file, so a sweeper
          that can lock a temporary file exclusively knows its writer is dead.
        * The descriptor is tracked by :mod:`asynccache.bridge.forksafe`: a forked child closes
          its copy at once and this object forgets it there, so only the writer's own
          process keeps the file "alive" (and, once published, held shared).
        * :meth:`publish` makes the final name appear complete or not at all
          (``os.replace``). Durable: stamped with the boot first (:mod:`.stamp`), or,
          where no stamp can be written, fsynced before and its directory after.
        * After :meth:`publish` or :meth:`discard` the descriptor is closed.

    Args:
        final: the published name.
        size: bytes to preallocate.
        durable: a power loss must not leave the name over bytes nobody checks again:
            the file is stamped with ``stamp`` before the rename or, without one (or
            where the file system refuses it), fsynced, and its directory after.
        stamp: this boot's id (:func:`.stamp.boot_id`), or None to fsync.
        allocate: preallocate now; False leaves the file empty until :meth:`allocate`
            (a reservation creates it before taking the eviction lock, and preallocates
            it after letting the lock go).
        ensure_dir: called once when the directory is missing (deleted underneath),
            to rebuild it before trying again.

    Raises:
        DiskFullError: preallocation found the disk full (names the directory).
        CacheError: the file cannot be created.
    """

    def __init__(
        self,
        final: Path,
        size: int,
        *,
        durable: bool = True,
        stamp: bytes | None = None,
        ensure_dir: Callable[[], None] | None = None,
        allocate: bool = True,
    ) -> None:
        self.final = final
        self.size = size
        self.durable = durable
        self.stamp = stamp
        self.fd: int | None = None
        directory = final.parent
        rebuilt = ensure_dir is None
        for _ in range(4):
            name = f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
            self.path = directory / name
            try:
                fd = forksafe.open_fd(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            except FileNotFoundError as exc:
                if rebuilt:
                    raise cache_error(exc, directory) from exc
                assert ensure_dir is not None
                ensure_dir()  # the directory was deleted underneath us: rebuild, retry
                rebuilt = True
                continue
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
            forksafe.close_fd(fd)
        else:
            raise CacheError(f"cannot create a temporary file in {directory}")
        self.fd = fd
        forksafe.register(self)
        if allocate:
            try:
                self.allocate()
            except BaseException:
                self.discard()
                raise

    def allocate(self) -> None:
        """Preallocate the file's size (a full disk is found here, early). On failure the
        file stays, empty or part-allocated: the caller removes it.

        Raises:
            DiskFullError: the disk cannot hold ``size`` more bytes (names the directory).
            CacheError: another failure.
        """
        assert self.fd is not None
        try:
            if self.size > 0:
                os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            raise cache_error(exc, self.final.parent) from exc

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        """Write ``data`` at ``offset`` (parts of one chunk are written in place, any order).

        Raises:
            DiskFullError: the disk filled up (a filesystem whose preallocation does not
                reserve blocks, e.g. copy-on-write); the caller may evict and retry.
        """
        assert self.fd is not None
        try:
            while data:
                n = os.pwrite(self.fd, data, offset)
                data, offset = memoryview(data)[n:], offset + n
        except OSError as exc:
            raise cache_error(exc, self.final.parent) from exc

    @property
    def fsyncs(self) -> bool:
        """:meth:`publish` will fsync (durable, and no boot stamp to rely on)."""
        return self.durable and self.stamp is None

    def publish(self) -> None:
        """Rename the file to its final name, atomically; durable, stamp it with the boot
        first or, failing that, fsync it (see :mod:`.stamp`)."""
        assert self.fd is not None
        try:
            # Preallocation gave the file its size already. A truncate to the same size
            # is not free on ext4 (it trims blocks past the end under a journal handle,
            # which waits for a commit in flight): only a file written past it needs one.
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
            synced = False
            if self.durable and (self.stamp is None or not stamps.mark(self.fd, self.stamp)):
                os.fsync(self.fd)
                synced = True
                stamps.mark(self.fd, stamps.SYNCED)  # trusted in later boots, where kept
            # Renamed under the exclusive lock: converting a flock is not atomic
            # everywhere (flock(2); older kernels let a waiter in between), and a settle
            # that locked the temporary name in that gap would sweep a live download.
            # Then downgraded, not dropped: the chunk is held shared (like a pin) until
            # the descriptor closes.
            os.replace(self.path, self.final)
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            if synced:
                fsync_dir(self.final.parent)
        except OSError as exc:
            self.discard()
            raise cache_error(exc, self.final.parent) from exc
        finally:
            self._close()

    def discard(self) -> bool:
        """Remove the temporary file. Idempotent; a no-op in a forked child.

        True when this call removed it (False: closed already, or gone underneath).
        """
        if self.fd is None:
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        finally:
            self._close()
        return True

    def _close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            forksafe.close_fd(fd)

    def _after_fork_in_child(self) -> None:
        # forksafe already closed the descriptor; the file belongs to the parent.
        self.fd = None


def sweep_orphans(directory: str | os.PathLike[str]) -> list[str]:
    """Delete temporary files whose writer is gone (nobody holds their flock).

    Returns the names removed. Only names :class:`TempFile` creates are looked at. A file
    a live writer is using is never removed: its lock makes the exclusive, non-blocking
    flock fail here.
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
            fd = forksafe.open_fd(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            if try_lock(fd, exclusive=True) and os.stat(entry.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:
            pass
        finally:
            forksafe.close_fd(fd)
    return removed
