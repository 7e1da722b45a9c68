"""``CacheDataLoader``: the first epoch writes the dataset to chunks, later epochs read them."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from ..errors import CacheError, ConfigError
from ..format import INDEX_NAME
from ..writer import merge_dir, read_index, remove_partial
from . import distributed
from .cache import Cache
from .sampling import EpochSampler, epoch_order, rank_share

_UNSUPPORTED = ("sampler", "batch_sampler")
MERGE_TIMEOUT_S = 3600.0


def _identity(batch: Any) -> Any:
    return batch


def _owned_cache(dataset: Any) -> Cache | None:
    """The ``Cache`` a dataset keeps as an attribute (the "fills itself" pattern), if any."""
    if isinstance(dataset, Cache):
        return dataset
    for value in getattr(dataset, "__dict__", {}).values():
        if isinstance(value, Cache):
            return value
    return None


class _CachedItems(Dataset[Any]):
    """Map-style view of a filled cache."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, key: int) -> Any:
        return self.cache[key]


class _WritePass(IterableDataset[Any]):
    """One rank's first epoch: DataLoader worker ``w`` handles batches ``w, w+W, ...``.

    That is exactly the round-robin order in which a DataLoader over a map-style dataset
    would hand out batches, so the batches come out in the same order as a later epoch's.
    Every key of the rank is read and written once, also the ones a ``drop_last`` batch
    drops (they are written, not yielded); padded repeats are yielded, not written.
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


class CacheDataLoader:
    """Iterate a dataset in batches; the first epoch also writes it to a chunked cache.

    Epoch 1 reads the wrapped map-style dataset and writes its items: each DataLoader
    worker of each rank writes its own ``chunk-{writer}-{n}.bin`` and
    ``{writer}.index.json``, merged into ``index.json`` when the epoch ends. Later epochs,
    and later processes, read from the cache and never touch the dataset.
    A dataset that owns a :class:`Cache` attribute and fills it in ``__getitem__`` works
    too: the loader drives it and finishes its writers.

    Batches collate as torch's ``default_collate`` would. Under ``torch.distributed`` each
    rank iterates its share (padded to equal length, like ``DistributedSampler``). The
    order of epoch ``e`` depends only on ``(seed, e)``; each ``iter()`` starts the next
    epoch (or set it with :meth:`set_epoch`).

    Args:
        dataset: a map-style dataset, a :class:`Cache`, or the path of a written dataset.
        cache_dir: where to write the chunks (not needed when the dataset owns a Cache).
        chunk_bytes / chunk_size: chunk limits for writing (see :class:`Cache`).
        batch_size, num_workers, shuffle, drop_last, collate_fn: as torch's DataLoader.
        seed: the shuffle seed.
        **kwargs: passed to torch's DataLoader (``pin_memory``, ``timeout``,
            ``multiprocessing_context``, ``worker_init_fn``, ``prefetch_factor``...).
    """

    def __init__(
        self,
        dataset: Any,
        cache_dir: str | os.PathLike[str] | None = None,
        chunk_bytes: int | None = None,
        chunk_size: int | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        for name in _UNSUPPORTED:
            if kwargs.get(name) is not None:
                raise ConfigError(
                    f"CacheDataLoader orders items itself (shuffle, seed); {name}= is not supported"
                )
        if batch_size is None or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(dataset, (str, os.PathLike)):
            dataset = Cache(dataset)
        owned = _owned_cache(dataset)
        if owned is not None:
            self.cache, self._owned = owned, owned is not dataset
        elif cache_dir is not None:
            self.cache = Cache(cache_dir, chunk_size=chunk_size, chunk_bytes=chunk_bytes)
            self._owned = False
        else:
            raise ConfigError(
                "CacheDataLoader needs cache_dir= (where to write the chunks) "
                "unless the dataset keeps its own Cache"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        self.kwargs = kwargs
        self._epoch = 0
        self._check_matches()

    def _check_matches(self) -> None:
        if (
            self.cache.filled
            and isinstance(self.dataset, Sized)
            and self.dataset is not self.cache
            and len(self.dataset) != len(self.cache)
        ):
            raise ConfigError(
                f"{self.cache.input_dir} holds {len(self.cache)} items but the dataset has "
                f"{len(self.dataset)}; delete the directory or choose another cache_dir"
            )

    # -- epochs --------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` runs."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def _length(self) -> int:
        return len(self.cache) if self.cache.filled else len(self.dataset)

    def __len__(self) -> int:
        world = distributed.current()
        per_rank = -(-self._length() // world.world_size)
        if self.drop_last:
            return per_rank // self.batch_size
        return -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch
        self._epoch += 1
        if self.cache.filled:
            return self._read_epoch(epoch)
        return self._write_epoch(epoch)

    def _loader(self, dataset: Any, **kw: Any) -> DataLoader[Any]:
        return DataLoader(dataset, num_workers=self.num_workers, **kw, **self.kwargs)

    def _read_epoch(self, epoch: int) -> Iterator[Any]:
        world = distributed.current()
        source = self.dataset if self._owned else _CachedItems(self.cache)
        sampler = EpochSampler(
            len(self.cache),
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            rank=world.rank,
            world_size=world.world_size,
        )
        yield from self._loader(
            source,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=self.drop_last,
            collate_fn=self.collate_fn,
        )

    def _write_epoch(self, epoch: int) -> Iterator[Any]:
        world = distributed.current()
        token = None
        if world.rank == 0:
            remove_partial(self.cache.input_dir)
            token = secrets.token_hex(8)
        token = str(distributed.broadcast(token))
        n = len(self.dataset)
        share = rank_share(
            epoch_order(n, shuffle=self.shuffle, seed=self.seed, epoch=epoch),
            world.rank,
            world.world_size,
        )
        bs = self.batch_size
        batches = [share[i : i + bs] for i in range(0, len(share), bs)]
        leftover: list[tuple[int, bool]] = []
        if self.drop_last and batches and len(batches[-1]) < bs:
            leftover = batches.pop()
        nw = max(1, self.num_workers)
        source = _WritePass(
            self.dataset,
            self.cache,
            self._owned,
            batches,
            leftover,
            world.rank,
            nw,
            token,
            self.collate_fn,
        )
        yield from self._loader(source, batch_size=None, collate_fn=_identity)
        writers = range(world.world_size * nw)
        if world.rank == 0:
            merge_dir(
                self.cache.input_dir,
                writers,
                token=token,
                timeout_s=MERGE_TIMEOUT_S,
                config={**self._write_config(), "token": token},
            )
        else:
            _wait_for_index(self.cache.input_dir, token, MERGE_TIMEOUT_S)

    def _write_config(self) -> dict[str, Any]:
        return {"chunk_bytes": self.cache.chunk_bytes, "chunk_size": self.cache.chunk_size}


def _wait_for_index(directory: str, token: str, timeout_s: float) -> None:
    """Block until rank 0 has published the ``index.json`` of this write pass."""
    path = os.path.join(directory, INDEX_NAME)
    deadline = time.monotonic() + timeout_s
    while True:
        if os.path.exists(path) and read_index(path).config.get("token") == token:
            return
        if time.monotonic() > deadline:
            raise CacheError(f"{path} was not written by rank 0 within {timeout_s}s")
        time.sleep(0.05)
