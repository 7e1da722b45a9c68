"""The first epoch of a ``CacheDataLoader``: read the source dataset, write it to chunks."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset

from ..errors import CacheError, WriteConflictError
from ..format import INDEX_NAME
from ..write.writelock import WriteLock, is_held, read_holder
from ..write.writer import MERGE_STALL_S, ProgressWait, read_index
from . import distributed
from .cache import Cache

_FAILED = "!"  # a broadcast token starting with this carries rank 0's error instead


def claim_directory(directory: str, token: str) -> tuple[WriteLock | None, str]:
    """Rank 0: take the write lock of ``directory`` for the new pass ``token``.

    Returns ``(lock, token)``; on failure ``(None, "!<message>")``, for
    :func:`check_claim` to raise on every rank after the broadcast (so no rank waits
    for a pass that never starts).
    """
    try:
        lock = WriteLock.acquire(directory, token)
    except CacheError as exc:
        return None, _FAILED + str(exc)
    if os.path.exists(os.path.join(directory, INDEX_NAME)):
        lock.release()
        return None, (
            f"{_FAILED}{directory}: another job finished writing the dataset while this one "
            "was starting; iterate again to read it"
        )
    return lock, token


def check_claim(token: str) -> str:
    """The pass token, or WriteConflictError with rank 0's message."""
    if token.startswith(_FAILED):
        raise WriteConflictError(token[len(_FAILED) :])
    return token


def owned_cache(dataset: Any) -> Cache | None:
    """The ``Cache`` a dataset keeps as an attribute (the "fills itself" pattern), if any."""
    if isinstance(dataset, Cache):
        return dataset
    for value in getattr(dataset, "__dict__", {}).values():
        if isinstance(value, Cache):
            return value
    return None


class MapWritePass(IterableDataset[Any]):
    """One rank's first epoch over a map-style dataset.

    DataLoader worker ``w`` handles batches ``w, w+W, ...``: exactly the round-robin order
    in which a DataLoader over a map-style dataset hands out batches, so batches come out
    in the same order as torch's DataLoader would give them. Every key of the rank is read
    and written once, also those of a batch ``drop_last`` drops (written, not yielded);
    padded repeats are yielded, not written.
    """

    def __init__(
        self,
        dataset: Any,
        cache: Cache,
        owned: bool,
        batches: list[list[tuple[int, bool]]],
        leftover: list[tuple[int, bool]],
        rank: int,
        num_workers: int,
        token: str,
        collate_fn: Callable[[list[Any]], Any],
    ) -> None:
        self.dataset, self.cache, self.owned = dataset, cache, owned
        self.batches, self.leftover = batches, leftover
        self.rank, self.num_workers, self.token = rank, num_workers, token
        self.collate_fn = collate_fn

    def __iter__(self) -> Iterator[Any]:
        world = distributed.current(self.num_workers)
        w, nw = world.worker, world.num_workers
        cache = self.cache
        cache.begin_write(self.rank * nw + w, self.token)
        try:
            for b in range(w, len(self.batches), nw):
                yield self.collate_fn([self._item(k, first) for k, first in self.batches[b]])
            if self.leftover and len(self.batches) % nw == w:
                for k, first in self.leftover:
                    self._item(k, first)
        except GeneratorExit:
            cache.abandon_write()  # an abandoned pass publishes no index
            raise
        cache.finish_write()

    def _item(self, key: int, first: bool) -> Any:
        if self.owned:  # the dataset writes itself in __getitem__
            with self.cache.accepting(first):
                return self.dataset[key]
        item = self.dataset[key]
        if first:
            self.cache[key] = item
        return item


class IterableWritePass(IterableDataset[Any]):
    """One rank's first epoch over an ``IterableDataset``: write each item as it passes.

    The source shards itself over workers (as any torch ``IterableDataset`` must). Each
    writer numbers its items ``0 .. n-1``; the merge shifts them so the keys of writer 0
    come first, then writer 1's, and so on.
    """

    def __init__(self, dataset: Any, cache: Cache, rank: int, num_workers: int, token: str) -> None:
        self.dataset, self.cache = dataset, cache
        self.rank, self.num_workers, self.token = rank, num_workers, token

    def __iter__(self) -> Iterator[Any]:
        world = distributed.current(self.num_workers)
        cache = self.cache
        cache.begin_write(self.rank * world.num_workers + world.worker, self.token)
        try:
            for key, item in enumerate(self.dataset):
                cache[key] = item
                yield item
        except GeneratorExit:
            cache.abandon_write()
            raise
        cache.finish_write()


def wait_for_index(directory: str, token: str, stall_s: float = MERGE_STALL_S) -> None:
    """Block until rank 0 has published the ``index.json`` of this write pass.

    Fails fast when rank 0 can't publish it any more: another job holds the directory
    (``WriteConflictError``), or rank 0 runs on this host and no longer holds the write
    lock (it died). Otherwise bounded by progress: ``CacheError`` once nothing in the
    directory changed for ``stall_s`` seconds.
    """
    path = os.path.join(directory, INDEX_NAME)
    wait = ProgressWait(directory, stall_s)

    def published() -> bool:
        return os.path.exists(path) and read_index(path).config.get("token") == token

    while not published():
        failure = _lost_pass(directory, token)
        if failure is not None:
            if published():  # rank 0 published and let go between the two looks
                return
            raise failure
        if wait.stalled():
            raise CacheError(
                f"{path} was not published by rank 0 and nothing in {directory} changed "
                f"for {stall_s:.0f}s: rank 0 is gone"
            )


def _lost_pass(directory: str, token: str) -> CacheError | None:
    """Why rank 0 can no longer publish pass ``token``, or None while it still may."""
    holder = read_holder(directory)
    if holder is None:
        return CacheError(
            f"{directory}: rank 0 released the write lock without publishing {INDEX_NAME}: "
            "it stopped or crashed"
        )
    if holder.get("token") != token:
        return WriteConflictError(
            f"{directory}: another job took the directory over (pid {holder.get('pid')} "
            f"on {holder.get('host')}); this pass's {INDEX_NAME} will never come"
        )
    # flock is reliable on one host only; across hosts, progress decides.
    if holder.get("host") == socket.gethostname() and not is_held(directory):
        return CacheError(
            f"{directory}: rank 0 (pid {holder.get('pid')}) no longer holds the write lock "
            f"and did not publish {INDEX_NAME}: it stopped or crashed"
        )
    return None
