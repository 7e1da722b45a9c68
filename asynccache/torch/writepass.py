"""The first epoch of a ``CacheDataLoader``: read the source dataset, write it to chunks."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch.utils.data import IterableDataset

from ..errors import CacheError, WriteConflictError
from ..format import INDEX_NAME
from ..write.writelock import WriteLock, is_held, read_holder
from ..write.writer import MERGE_STALL_S, ProgressWait, merge_dir, read_index, remove_partial
from . import distributed
from .cache import Cache
from .map_order import epoch_order, rank_share
from .workers import lazy

_FAILED = "!"  # a broadcast token starting with this carries rank 0's error instead


def identity(batch: Any) -> Any:
    """The collate function of loaders whose dataset yields whole batches."""
    return batch


class WriteOrder(NamedTuple):
    """Which batches a write pass hands out: those of ``epoch`` in the loader's order,
    after the first ``skip`` (received before a restart)."""

    epoch: int
    skip: int
    shuffle: bool
    seed: int
    batch_size: int
    drop_last: bool


def write_pass(
    dataset: Any,
    cache: Cache,
    order: WriteOrder,
    *,
    owned: bool,
    num_workers: int,
    collate_fn: Callable[..., Any],
    make_loader: Callable[..., Any],
) -> Iterator[Any]:
    """This rank's part of the first epoch of ``dataset``: its batches, each written to
    ``cache`` by the worker that made it (``make_loader(source, **kw)``: a DataLoader with
    the consumer's settings), then the pieces merged into ``index.json`` (rank 0) or
    waited for (the others).

    Invariants: rank 0 holds the directory's write lock from before the first write until
    ``index.json`` is published, so another job gets ``WriteConflictError`` and no file of
    this pass is deleted by anyone; every rank raises rank 0's failure to claim it rather
    than wait for a pass that never starts; both waits are bounded by the writers'
    progress, not by a fixed time; the lock is released also when the consumer abandons
    the epoch.
    """
    world = distributed.current()
    token = None
    lock = None
    if world.rank == 0:
        lock, token = claim_directory(cache.input_dir, secrets.token_hex(8))
        if lock is not None:
            remove_partial(cache.input_dir, token)
    token = check_claim(str(distributed.broadcast(token)))
    try:
        iterable = isinstance(dataset, IterableDataset)
        source: IterableDataset[Any]
        if iterable:
            source = IterableWritePass(dataset, cache, world.rank, num_workers, token)
            loader = make_loader(
                source,
                batch_size=order.batch_size,
                drop_last=order.drop_last,
                collate_fn=collate_fn,
            )
        else:
            n = len(dataset)
            keys = epoch_order(n, shuffle=order.shuffle, seed=order.seed, epoch=order.epoch)
            share = rank_share(keys, world.rank, world.world_size)
            bs = order.batch_size
            batches = [share[i : i + bs] for i in range(0, len(share), bs)]
            leftover: list[tuple[int, bool]] = []
            if order.drop_last and batches and len(batches[-1]) < bs:
                leftover = batches.pop()
            source = MapWritePass(
                dataset,
                cache,
                owned,
                batches,
                leftover,
                world.rank,
                num_workers,
                token,
                collate_fn,
            )
            loader = make_loader(source, batch_size=None, collate_fn=identity)
        for i, batch in enumerate(lazy(loader)):
            if i >= order.skip:
                yield batch
        writers = range(world.world_size * num_workers)
        if world.rank == 0:
            merge_dir(
                cache.input_dir, writers, token=token, config={"token": token}, renumber=iterable
            )
        else:
            wait_for_index(cache.input_dir, token)
    finally:
        if lock is not None:
            lock.release()


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
