"""``UnitStorage``: units of other sources (row groups, packs of files) as cache objects.

The downloader fetches an object by name into the cache, in ranged parts, with retries.
A unit of a Parquet prefix or a folder of files is not an object: it is byte ranges of
one file (a row group's column chunks) or whole small files, back to back. This backend
presents each unit as an object under its unit name, so everything the downloader and
the cache do for chunks (single flight per node, parts, retries, the budget, eviction by
the plan) works for units unchanged: a range of a unit becomes GETs of the ranges of the
files it covers.

Invariants:
    * A range of a unit is the bytes of its pieces, in order; every byte comes from the
      file and offset the index records, and a piece whose file answers with fewer bytes
      than the index says fails (a short body is retried, then reported).
    * Pieces of several small files are fetched at once (at most ``concurrency``
      requests), and written to the sink in order.
    * With ``verify_after``, a range is handed over only after a ``HEAD`` made after its
      bytes arrived found each file it read as the index describes it (size, and ETag
      where the index has one): a file rewritten under a running job fails with
      :class:`DatasetRewrittenError` naming the file, never with rows of two versions.
    * :meth:`head` of a unit checks its files the same way; a file gone is
      :class:`DatasetRewrittenError` too (named), not a missing unit.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

import xxhash

from ..errors import DatasetRewrittenError, ObjectNotFoundError, StorageError
from ..storage.base import ObjectInfo, Sink, Storage

__all__ = ["Piece", "Unit", "UnitStorage"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + length)`` of file ``key`` (listed as ``size`` bytes with
    ETag ``etag``)."""

    key: str
    start: int
    length: int
    size: int
    etag: str


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit: its pieces, back to back; ``where`` names it in messages."""

    pieces: tuple[Piece, ...]
    where: str

    @property
    def size(self) -> int:
        return sum(p.length for p in self.pieces)


class _Counting:
    """A sink that remembers whether its owner stopped taking bytes."""

    __slots__ = ("sink", "stopped")

    def __init__(self, sink: Sink) -> None:
        self.sink, self.stopped = sink, False

    def write(self, data: bytes | memoryview, /) -> bool:
        if self.stopped:
            return False
        ok = self.sink.write(data)
        self.stopped = not ok
        return ok

    def closing(self) -> None:
        self.sink.closing()


class UnitStorage(Storage):
    """The units of ``table`` over the files of ``inner``. See the module docstring.

    Args:
        inner: the storage of the source's files; closed with this one.
        table: unit name -> :class:`Unit` (read when a unit is asked for: it may be filled
            after this storage is made).
        verify_after: check each file read by a ``HEAD`` after its bytes arrived.
        check_etag: compare ETags too (False where a listing's ETag is not a HEAD's, and
            the files can't change: a pinned Hub commit).
        concurrency: requests at once for the pieces of one range.
    """

    is_local = False

    def __init__(
        self,
        inner: Storage,
        table: Mapping[str, Unit],
        *,
        verify_after: bool,
        check_etag: bool = True,
        concurrency: int = 16,
    ) -> None:
        self.inner, self.table = inner, table
        self.url = inner.url
        self.verify_after, self.check_etag = verify_after, check_etag
        self.concurrency = max(1, concurrency)

    def __repr__(self) -> str:
        return f"UnitStorage({self.inner!r}, units={len(self.table)})"

    def _unit(self, name: str) -> Unit:
        unit = self.table.get(name)
        if unit is None:
            url = self.inner.object_url(name)
            raise ObjectNotFoundError(f"{url}: no such unit in this source's index", url=url)
        return unit

    def object_url(self, key: str) -> str:
        unit = self.table.get(key)
        return unit.where if unit is not None else self.inner.object_url(key)

    # -- checks ----------------------------------------------------------------------
    async def _check(self, piece: Piece) -> ObjectInfo:
        url = self.inner.object_url(piece.key)
        try:
            info = await self.inner.head(piece.key)
        except ObjectNotFoundError as exc:
            raise DatasetRewrittenError(
                f"{url}: gone since the source was indexed (listed with {piece.size} bytes); "
                "open the dataset again to read what is there now"
            ) from exc
        if info.size != piece.size:
            raise DatasetRewrittenError(
                f"{url}: changed since the source was indexed: {info.size} bytes now, "
                f"{piece.size} when listed; no row of it is read from two versions: open the "
                "dataset again to read the new version"
            )
        if self.check_etag and piece.etag and info.etag and info.etag != piece.etag:
            raise DatasetRewrittenError(
                f"{url}: changed since the source was indexed: its ETag is {info.etag} now, "
                f"{piece.etag} when listed; no row of it is read from two versions: open the "
                "dataset again to read the new version"
            )
        return info

    async def _head_impl(self, key: str) -> ObjectInfo:
        unit = self._unit(key)
        seen: dict[str, Piece] = {}
        for p in unit.pieces:
            seen.setdefault(p.key, p)
        infos = await _bounded([self._check(p) for p in seen.values()], self.concurrency)
        tag = xxhash.xxh3_64("\0".join(str(i.etag) for i in infos).encode()).hexdigest()
        return ObjectInfo(key=key, size=unit.size, etag=tag)

    # -- reads -----------------------------------------------------------------------
    def _overlap(self, unit: Unit, start: int, end: int) -> list[tuple[Piece, int, int]]:
        """``(piece, file start, file end)`` of the pieces under unit bytes ``[start, end)``."""
        out = []
        pos = 0
        for p in unit.pieces:
            lo, hi = max(start, pos), min(end, pos + p.length)
            if lo < hi:
                out.append((p, p.start + lo - pos, p.start + hi - pos))
            pos += p.length
            if pos >= end:
                break
        return out

    async def _receive_into_impl(self, key: str, start: int, end: int, sink: Sink) -> None:
        unit = self._unit(key)
        parts = self._overlap(unit, start, end)
        counting = _Counting(sink)
        if len(parts) == 1 or all(b - a >= (1 << 20) for _, a, b in parts):
            for piece, a, b in parts:  # large ranges: streamed into the sink as they come
                if counting.stopped:
                    break
                await self.inner.receive_into(piece.key, a, b, counting)
        else:  # small files: fetched at once, handed over in order
            bodies = await _bounded(
                [self._read(piece, a, b) for piece, a, b in parts], self.concurrency
            )
            try:
                for body in bodies:
                    if not counting.write(body):
                        break
            finally:
                counting.closing()
        if self.verify_after:  # (a sink that took its last byte said "stop" too)
            seen = {p.key: p for p, _, _ in parts}
            await _bounded([self._check(p) for p in seen.values()], self.concurrency)

    async def _read(self, piece: Piece, a: int, b: int) -> bytes:
        body = await self.inner.read(piece.key, a, b)
        if len(body) != b - a:
            url = self.inner.object_url(piece.key)
            raise DatasetRewrittenError(
                f"{url}: answered {len(body)} bytes for [{a}, {b}) of a file listed with "
                f"{piece.size} bytes: changed since it was listed; open the dataset again"
            )
        return body

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        unit = self._unit(key)
        for piece, a, b in self._overlap(unit, start, unit.size if end is None else end):
            yield await self._read(piece, a, b)

    async def _list_impl(self, prefix: str) -> builtins.list[ObjectInfo]:
        return [
            ObjectInfo(name, u.size) for name, u in self.table.items() if name.startswith(prefix)
        ]

    async def _upload_impl(self, src: str, key: str) -> int:
        raise StorageError(f"{self.url}: units are read-only", url=self.object_url(key))

    async def _delete_impl(self, key: str) -> None:
        raise StorageError(f"{self.url}: units are read-only", url=self.object_url(key))

    async def close(self) -> None:
        await self.inner.close()


async def _bounded(coros: list[Awaitable[T]], limit: int) -> list[T]:
    """The results of ``coros`` in order, at most ``limit`` running at once; the first
    failure cancels the rest."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Awaitable[T]) -> T:
        async with sem:
            return await c

    tasks = [asyncio.ensure_future(one(c)) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
