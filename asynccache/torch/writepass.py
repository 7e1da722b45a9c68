"""The first epoch of a ``CacheDataLoader``: read the source dataset, write it to chunks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset

from ..errors import CacheError
from ..format import INDEX_NAME
from ..writer import read_index
from . import distributed
from .cache import Cache


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
        cache._begin_write(self.rank * nw + w, self.token)
        try:
            for b in range(w, len(self.batches), nw):
                yield self.collate_fn([self._item(k, first) for k, first in self.batches[b]])
            if self.leftover and len(self.batches) % nw == w:
                for k, first in self.leftover:
                    self._item(k, first)
        except GeneratorExit:
            cache._writer = None  # an abandoned pass publishes no index
            raise
        cache._finish_write()

    def _item(self, key: int, first: bool) -> Any:
        if self.owned:  # the dataset writes itself in __getitem__
            self.cache._accept = first
            try:
                return self.dataset[key]
            finally:
                self.cache._accept = True
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
        cache._begin_write(self.rank * world.num_workers + world.worker, self.token)
        try:
            for key, item in enumerate(self.dataset):
                cache[key] = item
                yield item
        except GeneratorExit:
            cache._writer = None
            raise
        cache._finish_write()


def wait_for_index(directory: str, token: str, timeout_s: float) -> None:
    """Block until rank 0 has published the ``index.json`` of this write pass (bounded)."""
    path = os.path.join(directory, INDEX_NAME)
    deadline = time.monotonic() + timeout_s
    while True:
        if os.path.exists(path) and read_index(path).config.get("token") == token:
            return
        if time.monotonic() > deadline:
            raise CacheError(f"{path} was not written by rank 0 within {timeout_s}s")
        time.sleep(0.05)
