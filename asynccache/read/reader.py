"""Reading items: key -> chunk -> mmap -> item, zero-copy for numpy and torch leaves.

The reader asks a ``resolve`` callable for the local path of a chunk; for a local
dataset that is the file in place, for a remote one the downloader fetches it first.
Chunks are mapped copy-on-write (``ACCESS_COPY``): leaves are writable views that share
pages with the file until written, and writing to them never changes the file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import xxhash

from ..bridge import forksafe
from ..cache.fsutil import file_identity
from ..cache.layout import reopens, shown_path
from ..download import heap
from ..download.ranges import RangeCheck
from ..errors import ChecksumMismatchError, DataError, ObjectNotFoundError, TruncatedChunkError
from ..format import ChunkEntry, ChunkView, Index, checksum, decode
from ..format.chunk import items_start, parse_header
from .verified import FileId, VerifiedFiles

Resolve = Callable[[int, ChunkEntry], str]
Release = Callable[[int], None]

log = logging.getLogger(__name__)

_COALESCE_GAP = 64 << 10  # items this close are fetched as one range
_RANGE_BYTES = 1 << 20  # ranges of about this size, fetched at once
_MIN_RANGE_CHUNK = 1 << 20  # a smaller chunk comes whole about as soon as its items by range
_EARLY_WAIT_S = 300.0  # outer bound; each request is bounded by timeout_s and retries


class Ranged(Protocol):
    """What a reader needs to read items before their chunk lands (a remote
    :class:`~asynccache.read.source.DatasetSource`)."""

    @property
    def first_read_bytes(self) -> int: ...

    def landed(self, ci: int) -> bool: ...

    def read_ranges(
        self,
        ci: int,
        ranges: list[tuple[int, int]],
        checks: list[RangeCheck | None] | None = None,
    ) -> concurrent.futures.Future[list[np.ndarray]]: ...

    def chunk_url(self, ci: int) -> str: ...

    def send_hint(self) -> None: ...


class _Early:
    """Items of one chunk read by range before the chunk landed.

    ``items``: position -> (buffer, start, end) not yet handed out, every byte of them
    verified on arrival (the header against the index, each item against its checksum
    in that header). ``failed``: the error that ended this chunk's range reads for good
    (the object was rewritten, or is damaged): raised by every read of the chunk this
    epoch, so no item of it is handed out.
    """

    __slots__ = ("failed", "items")

    def __init__(self, failed: DataError | None = None) -> None:
        self.items: dict[int, tuple[np.ndarray, int, int]] = {}
        self.failed = failed


class _Mapped:
    """A chunk mapped by a reader: ``path`` opens it (while pinned), ``name`` is what
    messages call it (see :func:`.cache.layout.shown_path`), ``ino`` its inode when
    ``path`` reaches it through a descriptor (checked when it is opened again)."""

    __slots__ = ("batch", "ino", "mm", "name", "path", "view")

    def __init__(
        self, mm: Any, view: ChunkView, path: str, name: str, ino: int | None = None
    ) -> None:
        self.mm, self.view, self.path, self.name, self.ino = mm, view, path, name, ino
        self.batch: Any = None  # the chunk's ChunkMap for batch assembly, once asked for


class ChunkMap(mmap.mmap):
    """A read-only shared mapping of a chunk file, with the file open (``fd``) beside it,
    for batch assembly (:mod:`asynccache.read.batchread`).

    Not the reader's own copy-on-write mapping: nothing hands out views of this one, so
    its pages can be dropped (``madvise(MADV_DONTNEED)``) once read, and large items can
    be copied from ``fd`` by ``preadv`` instead of through the mapping. Either way the
    bytes come from the page cache, and mapped pages of chunks already read do not stay
    in the process's memory (PSS). The file closes when the mapping is collected.
    """

    fd: int
    path: str

    @classmethod
    def open(
        cls, path: str, size: int, *, name: str | None = None, ino: int | None = None
    ) -> ChunkMap:
        """Map ``path``; ``name`` is what messages call it; ``ino``: the inode it must be
        (a path through a descriptor that was closed meanwhile reaches another file).

        Raises:
            ObjectNotFoundError: ``path`` no longer reaches inode ``ino``.
        """
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if ino is not None and os.fstat(fd).st_ino != ino:
                where = name or path
                raise ObjectNotFoundError(f"{where}: released while being mapped", url=where)
            m = cls(fd, size, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        m.fd, m.path = fd, name or path
        weakref.finalize(m, os.close, fd).atexit = False
        return m


def map_chunk(
    path: str,
    entry: ChunkEntry,
    *,
    verify: bool,
    name: str | None = None,
    trusted: Callable[[FileId], bool] | None = None,
) -> tuple[Any, ChunkView, FileId]:
    """Map ``path`` and check it against its index ``entry`` (size; checksum if ``verify``,
    unless ``trusted(identity)`` says a checksum passed for this file before: the same
    device, inode, size and times). Messages name ``name`` (default ``path``). Returns the
    mapping, its view and the file's identity.

    Raises:
        TruncatedChunkError, ChecksumMismatchError, BadMagicError, UnsupportedVersionError:
            naming the file.
    """
    shown = name or path
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; the mapping outlives it
    except FileNotFoundError as exc:
        raise ObjectNotFoundError(
            f"{shown}: chunk named in the index is missing", url=shown
        ) from exc
    with f:
        st = os.fstat(f.fileno())
        size = st.st_size
        ident = file_identity(st)
        if size != entry.bytes:
            raise TruncatedChunkError(
                f"{shown}: file has {size} bytes but the index says {entry.bytes}"
            )
        mm: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    if verify and not (trusted is not None and trusted(ident)):
        got = checksum(mm)
        if got != entry.checksum:
            raise ChecksumMismatchError(
                f"{shown}: checksum {got} does not match the index ({entry.checksum})"
            )
        # Hashing mapped every page: unmap them (nothing points into the mapping yet, so
        # nothing is lost; the pages stay in the page cache), or the whole chunk would stay
        # in this process's memory for as long as it is open.
        if size:
            mm.madvise(mmap.MADV_DONTNEED)
    view = ChunkView(mm, shown)
    if len(view) != entry.items:
        raise TruncatedChunkError(f"{shown}: holds {len(view)} items, the index says {entry.items}")
    if entry.tokens is not None and view.token_dtype is not None and view.tokens != entry.tokens:
        raise TruncatedChunkError(
            f"{shown}: holds {view.tokens} tokens, the index says {entry.tokens}"
        )
    return mm, view, ident


class Reader:
    """Random access to the items of one dataset.

    Thread-safe. Keeps up to ``max_open`` chunks mapped and calls ``release(ci)`` for each
    ``resolve`` once it drops that mapping; an item handed out keeps its own mapping alive
    for as long as it lives, so dropping a mapping never invalidates an item.

    Fork: a forked child starts with a new mutex and an empty table of open chunks. The
    inherited mappings were resolved (pinned) by the parent, so the child never releases
    them; items it already holds stay valid. Which chunks were verified is kept (the files
    are the same).
    """

    def __init__(
        self,
        index: Index,
        resolve: Resolve,
        *,
        verify: bool = True,
        allow_pickle: bool = False,
        max_open: int = 16,
        release: Release | None = None,
        ranged: Ranged | None = None,
    ) -> None:
        self.index = index
        self._resolve = resolve
        self._release = release
        self._verify = verify
        self._allow_pickle = allow_pickle
        self._max_open = max_open
        self._open: collections.OrderedDict[int, _Mapped] = collections.OrderedDict()
        # The file of each chunk a checksum passed for (a file put in its place later, a
        # rewritten dataset's, is checked again).
        self._verified: dict[int, FileId] = {}
        # The same, shared with the other processes reading this dataset (the dataset
        # and its DataLoader workers), when the caller provides it.
        self.shared_verified: VerifiedFiles | None = None
        self._lock = threading.Lock()
        self._ranged = ranged
        self._follow_source()
        self._reset_early()
        forksafe.register(self)

    def _trusted(self, ci: int) -> Callable[[FileId], bool]:
        """Whether a checksum passed for a file of chunk ``ci`` (see ``_verified``)."""
        mine, shared = self._verified.get(ci), self.shared_verified

        def trusted(ident: FileId) -> bool:
            return ident == mine or (shared is not None and shared.holds(ci, ident))

        return trusted

    def _follow_source(self) -> None:
        # The source may ask for mappings it gave back to be dropped (a full disk).
        add = getattr(self._ranged, "add_reader", None)
        if add is not None:
            add(self)

    def _reset_early(self) -> None:
        """A new epoch (or process): range reads allowed again, up to the budget."""
        self._early: dict[int, _Early] = {}
        self._early_left = self._ranged.first_read_bytes if self._ranged is not None else 0
        self._mapped_any = False  # a chunk was mapped since: no more range reads

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the mutex at the fork: it would never be released.
        self._lock = threading.Lock()
        # The parent's pins: releasing them here would unpin what this process never pinned.
        self._open = collections.OrderedDict()
        self._reset_early()

    def __len__(self) -> int:
        return self.index.total_items

    def __getitem__(self, key: int) -> Any:
        ci, pos = self.index.locate(key)
        return self.read(ci, pos)

    def read(self, chunk: int, pos: int) -> Any:
        """Item ``pos`` of chunk number ``chunk``."""
        early = self._early.get(chunk) if self._early else None
        if early is not None:
            if early.failed is not None:
                raise early.failed
            with self._lock:
                got = early.items.pop(pos, None)
            if got is not None:
                buf, start, end = got
                where = f"{self._where(chunk)} item {pos} (range read)"
                return decode(buf, start, end, where=where, allow_pickle=self._allow_pickle)
        m = self._chunk(chunk)
        start, end = m.view.span(pos)
        dt = m.view.token_dtype
        if dt is not None:  # a token chunk: the document is a view of the mapping
            return np.frombuffer(m.mm, dt, (end - start) // dt.itemsize, start)
        return decode(
            m.mm, start, end, where=f"{m.name} item {pos}", allow_pickle=self._allow_pickle
        )

    def fetches_no_chunk(
        self,
        chunks: np.ndarray,
        positions: np.ndarray,
        *,
        small: bool = False,
        whole: bool = False,
    ) -> bool:
        """Whether :meth:`expect` then reading items ``(chunks[i], positions[i])`` needs no
        chunk downloaded: each item's chunk is in the cache now, or the item is one
        :meth:`expect` would read by range. ``small``: chunks under 1 MiB may be
        downloaded whole (a writer's remainder, which comes whole about as soon as its
        items by range; a dataset written by several writers has one per writer, anywhere
        in the index), provided some item is read by range (the dataset is not one of
        small chunks only). ``whole``: as :meth:`expect`'s."""
        want: dict[int, list[int]] = {}
        if self._ranged is not None and self._early_left > 0 and not self._mapped_any:
            want = self._early_plan(chunks, positions, whole)
        sizes = self.index.bytes_per_chunk
        landed: dict[int, bool] = {}
        for ci, pos in zip(chunks.tolist(), positions.tolist(), strict=True):
            if pos in want.get(ci, ()):
                continue
            if ci not in landed:
                landed[ci] = self._ranged is None or self._ranged.landed(ci)
            if not landed[ci] and not (small and want and int(sizes[ci]) < _MIN_RANGE_CHUNK):
                return False
        return True

    def expect(self, chunks: np.ndarray, positions: np.ndarray, *, whole: bool = False) -> None:
        """Items ``(chunks[i], positions[i])`` are read next, in this order (``whole``:
        all of them before any is used, as one batch).

        At the start of an epoch, before this reader has mapped any chunk, the items
        whose chunk has not landed yet are fetched by HTTP Range into memory (their
        chunks keep downloading), up to ``first_read_bytes`` per epoch, so the first
        batch does not wait for whole chunks. Only chunks whose header checksum the
        index records are read so (chunk version 2): every range is verified as it
        arrives, before any of its bytes is handed out (the header against the index,
        each item against its checksum in that header), and fetched again when it does
        not match. A range read that fails otherwise (the network) is not an error:
        those items are read from their chunks. One that keeps failing verification
        (the chunk was rewritten, or is damaged) makes every read of its chunk this epoch
        raise that :class:`ChecksumMismatchError`.
        """
        if self._ranged is None:
            return
        try:
            if self._early_left <= 0 or self._mapped_any:
                return
            want = self._early_plan(chunks, positions, whole)
            if not want:
                self._early_left = 0  # nothing to fetch now: none later either
                return
            try:
                self._fetch_early(want)
            except Exception as exc:  # the chunk path retries, verifies and reports
                log.debug("range reads failed, reading from chunks: %r", exc)
            self._early_left = 0  # one round per epoch: the chunks are on their way
        finally:
            self._ranged.send_hint()  # the epoch's prefetch, held back until now

    def _early_plan(
        self, chunks: np.ndarray, positions: np.ndarray, whole: bool = False
    ) -> dict[int, list[int]]:
        """The positions to read by range, per chunk, within the byte budget; ``whole``
        (the items are used together, as a batch): a chunk's items all or none."""
        assert self._ranged is not None
        with self._lock:
            skip = set(self._open) | set(self._early)
        landed: dict[int, bool] = {}
        want: dict[int, list[int]] = {}
        if self.index.head_checksums is None:
            # Written before chunk version 2: a range of these chunks can't be verified
            # before the whole chunk is here, so their items wait for their chunks.
            return want
        left = self._early_left
        sizes = self.index.bytes_per_chunk
        counts = self.index.items_per_chunk
        item_bytes = sizes // np.maximum(counts, 1)  # (the header says exactly)
        for ci, pos in zip(chunks.tolist(), positions.tolist(), strict=True):
            if ci in skip:
                continue
            if ci not in landed:
                landed[ci] = (
                    int(sizes[ci]) < _MIN_RANGE_CHUNK
                    or self.index.tokens_per_chunk is not None
                    or self._ranged.landed(ci)
                )
            if landed[ci]:
                continue
            if not whole:  # items one by one: the first ones, while the budget lasts
                left -= int(item_bytes[ci])
                if left < 0:
                    break
            want.setdefault(ci, []).append(pos)
        if whole:
            # A batch waits for its last item: a chunk's items by range are worth it only
            # if none of them waits for that chunk (4 MiB items in order: two of a
            # batch's fifteen in one chunk by range saved nothing, and made the batch a
            # per-item one). All of a chunk's or none, in the order the items name them.
            kept: dict[int, list[int]] = {}
            for ci, ps in want.items():
                cost = len(ps) * int(item_bytes[ci])
                if cost <= left:
                    kept[ci], left = ps, left - cost
            want = kept
        # A chunk more than half of whose items would come by range is fetched whole
        # instead: about the same bytes, and it lands in the cache (items read by range
        # are not kept: a chunk read all by range would be read by range again the next
        # epoch, a warm one included).
        return {ci: ps for ci, ps in want.items() if 2 * len(set(ps)) <= int(counts[ci])}

    def _fetch_early(self, want: dict[int, list[int]]) -> None:
        """Headers of the chunks in ``want`` (one round), then their items (one more),
        each verified on arrival (see :meth:`expect`)."""
        assert self._ranged is not None
        counts = self.index.items_per_chunk
        sizes = self.index.bytes_per_chunk
        heads_ck = self.index.head_checksums
        assert heads_ck is not None
        heads = {}
        for ci in want:
            span = (0, items_start(int(counts[ci])))
            check = RangeCheck(int(sizes[ci]), _header_check(int(heads_ck[ci])))
            heads[ci] = (span, check, self._ranged.read_ranges(ci, [span], [check]))
        early: dict[int, _Early] = {}
        bodies: dict[int, tuple[list[tuple[int, int]], concurrent.futures.Future[Any]]] = {}
        tables: dict[int, np.ndarray] = {}  # each chunk's item offsets, from its header
        left = self._early_left
        for ci, (span, head_check, fut) in heads.items():
            got = _outcome(fut, self._where(ci))
            if not isinstance(got, list):
                if got is not None:
                    early[ci] = _Early(got)
                continue
            try:
                offsets, sums = parse_header(
                    got[0], int(counts[ci]), int(sizes[ci]), self._where(ci)
                )
            except DataError as exc:  # verified, yet not the index's: the writer's fault
                early[ci] = _Early(exc)
                continue
            tables[ci] = offsets
            spans = []
            for pos in want[ci]:
                start, end = int(offsets[pos]), int(offsets[pos + 1])
                if end - start > left:
                    break
                left -= end - start
                spans.append((start, end))
            if spans:
                ranges = _coalesce(spans, _COALESCE_GAP, _RANGE_BYTES)
                origin = (span[0], span[1], head_check.check)
                checks: list[RangeCheck | None] = [
                    RangeCheck(
                        int(sizes[ci]),
                        _ItemsCheck(offsets, sums, lo, hi, self.index, ci),
                        origin,
                    )
                    for lo, hi in ranges
                ]
                bodies[ci] = (ranges, self._ranged.read_ranges(ci, ranges, checks))
        for ci, (ranges, fut) in bodies.items():
            got = _outcome(fut, self._where(ci))
            if not isinstance(got, list):
                if got is not None:
                    early[ci] = _Early(got)
                continue
            e = early[ci] = _Early()
            offsets = tables[ci]
            for (lo, hi), buf in zip(ranges, got, strict=True):
                for pos in want[ci]:
                    start, end = int(offsets[pos]), int(offsets[pos + 1])
                    if lo <= start and end <= hi:
                        e.items[pos] = (buf, start - lo, end - lo)
        with self._lock:
            self._early.update(early)

    def _drop_early(self, ci: int) -> None:
        """Chunk ``ci`` is mapped: its items not read yet come from the mapping, and the
        buffers read by range for it go (a failure stays: it is this epoch's answer)."""
        with self._lock:
            early = self._early.get(ci)
            if early is None or early.failed is not None:
                return
            del self._early[ci]
            left = any(e.failed is None for e in self._early.values())
        del early
        if not left:
            # The last range-read buffers are gone: give the heap's free pages back (the
            # pieces they were received in stayed resident in the I/O thread's arena).
            heap.trim()

    def _where(self, ci: int) -> str:
        if self._ranged is not None:
            return self._ranged.chunk_url(ci)
        return self.index.filename(ci)

    def chunk_tokens(self, chunk: int) -> np.ndarray:
        """Every token of token chunk number ``chunk``, as one view of its mapping.

        Raises:
            DataError: the chunk holds items, not tokens.
        """
        m = self._chunk(chunk)
        dt = m.view.token_dtype
        if dt is None:
            raise DataError(f"{m.name}: holds items, not tokens (written without tokens=)")
        if not m.view.tokens:
            return np.empty(0, dt)
        return np.frombuffer(m.mm, dt, m.view.tokens, m.view.token_start)

    def _chunk(self, ci: int) -> _Mapped:
        with self._lock:
            m = self._open.get(ci)
            if m is not None:
                self._open.move_to_end(ci)
                return m
        entry = self.index.chunks[ci]
        path = self._resolve(ci, entry)
        name = shown_path(path)
        try:
            mm, view, ident = map_chunk(
                path, entry, verify=self._verify, name=name, trusted=self._trusted(ci)
            )
            # A chunk not published yet, reached through its downloader's descriptor
            # (see ChunkStore.pin): remember the inode for mapped().
            ino = os.stat(path).st_ino if reopens(path) else None
        except BaseException:
            self._released(ci)
            raise
        m = _Mapped(mm, view, path, name, ino)
        self._mapped_any = True
        if self._early:
            self._drop_early(ci)
        shared = self.shared_verified
        if self._verify and shared is not None and not shared.holds(ci, ident):
            shared.put(ci, ident)
        dropped = []
        with self._lock:
            self._verified[ci] = ident
            if ci in self._open:  # another thread mapped it meanwhile: keep one
                dropped.append(ci)
                m = self._open[ci]
            else:
                self._open[ci] = m
            while len(self._open) > self._max_open:
                dropped.append(self._open.popitem(last=False)[0])
        for d in dropped:
            self._released(d)
        return m

    def _released(self, ci: int) -> None:
        if self._release is not None:
            self._release(ci)

    def release(self, ci: int) -> None:
        """Drop this reader's mapping of chunk ``ci`` (items already returned stay valid)."""
        with self._lock:
            held = self._open.pop(ci, None)
        if held is not None:
            self._released(ci)

    def close(self) -> None:
        """Drop every mapping (items already returned stay valid) and the items read by
        range not handed out; the next epoch may read by range again."""
        held = bool(self._early)
        self._reset_early()
        if held:
            heap.trim()
        with self._lock:
            dropped = list(self._open)
            self._open.clear()
        for ci in dropped:
            self._released(ci)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = collections.OrderedDict()
        state["_early"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._follow_source()
        self._reset_early()  # a new process reads its first items by range again
        forksafe.register(self)

    def by_range(self, chunk: int) -> bool:
        """Items of ``chunk`` were read by range this epoch (its chunk not landed then):
        they come from those reads, not from a mapping of the chunk."""
        return bool(self._early) and chunk in self._early

    def item_mapping(self, chunk: int) -> tuple[Any, np.ndarray]:
        """Chunk ``chunk``'s copy-on-write mapping (what :meth:`read` views items from:
        writable, as ``default_collate`` expects) and its item offsets table."""
        m = self._chunk(chunk)
        return m.mm, m.view._offsets

    def mapped(self, chunk: int) -> tuple[Any, np.ndarray]:
        """Chunk ``chunk``'s bytes and item offsets table (``count + 1`` int64 byte
        offsets), for readers that copy many items at once (batch assembly): a
        :class:`ChunkMap` of the file (the same one while this reader keeps the chunk
        open; ``b""`` for an empty chunk). It stays valid for as long as it is
        referenced, like an item's."""
        m = self._chunk(chunk)
        if m.batch is None:
            m.batch = (
                ChunkMap.open(m.path, len(m.mm), name=m.name, ino=m.ino) if len(m.mm) else m.mm
            )
        return m.batch, m.view._offsets

    def set_range_budget(self, nbytes: int) -> None:
        """This epoch's byte budget for range reads, in place of ``first_read_bytes``
        (the next epoch starts from ``first_read_bytes`` again): the main process that
        builds several DataLoader workers' first batches reads for all of them, and a
        worker whose first batch it built reads none."""
        with self._lock:
            self._early_left = max(0, int(nbytes))


def _coalesce(spans: list[tuple[int, int]], gap: int, most: int) -> list[tuple[int, int]]:
    """Sorted, merged ``[start, end)`` ranges covering ``spans``; spans closer than
    ``gap`` bytes are fetched as one range (one request beats two small ones), up to
    ``most`` bytes a range (several requests at once beat one long one)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + gap and max(out[-1][1], end) - out[-1][0] <= most:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _result(fut: concurrent.futures.Future[Any]) -> Any:
    try:
        return fut.result(timeout=_EARLY_WAIT_S)
    except BaseException:
        fut.cancel()
        raise


def _header_check(want: int) -> Callable[[np.ndarray], str | None]:
    """The check of a chunk header read by range: its ``xxh3_64`` is ``want`` (the
    index's)."""

    def check(buf: np.ndarray) -> str | None:
        got = xxhash.xxh3_64_intdigest(buf.data)
        if got == want:
            return None
        return f"its header hashes to xxh3_64 {got:016x}, the index records {want:016x}"

    return check


class _ItemsCheck:
    """The check of bytes ``[lo, hi)`` of chunk ``ci`` read by range: every item within
    them hashes to its checksum in the chunk's (verified) header. What differs names the
    item's position and key."""

    __slots__ = ("ci", "hi", "index", "lo", "offsets", "sums")

    def __init__(
        self, offsets: np.ndarray, sums: np.ndarray, lo: int, hi: int, index: Index, ci: int
    ) -> None:
        self.offsets, self.sums, self.lo, self.hi = offsets, sums, lo, hi
        self.index, self.ci = index, ci

    def __call__(self, buf: np.ndarray) -> str | None:
        lo, hi, offsets = self.lo, self.hi, self.offsets
        p = int(np.searchsorted(offsets, lo, side="left"))
        last = len(offsets) - 1
        while p < last and int(offsets[p + 1]) <= hi:
            a, b = int(offsets[p]) - lo, int(offsets[p + 1]) - lo
            got = xxhash.xxh3_64_intdigest(buf[a:b].data)
            want = int(self.sums[p])
            if got != want:
                key = int(self.index.chunk_keys(self.ci)[p])
                return (
                    f"item {p} (key {key}) hashes to xxh3_64 {got:016x}, its checksum in "
                    f"the chunk's header is {want:016x}"
                )
            p += 1
        return None


def _outcome(fut: concurrent.futures.Future[Any], where: str) -> list[Any] | DataError | None:
    """The ranges of ``fut``; the :class:`DataError` that ended them for good (their
    bytes did not verify: a rewritten or damaged chunk); or None when they failed
    otherwise (the network), and the chunk path, which retries and reports, reads them."""
    try:
        return list(_result(fut))
    except DataError as exc:
        log.warning("%s: %s", where, exc)
        return exc
    except Exception as exc:
        log.debug("%s: range reads failed, reading from the chunk: %r", where, exc)
        return None
