"""``CacheDataLoader``: the first epoch writes the dataset to chunks, later epochs stream them."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, default_collate

from ..errors import ConfigError, ResumeStateError
from ..writer import merge_dir, remove_partial
from . import distributed
from .cache import Cache
from .map_order import EpochSampler, epoch_order, rank_share
from .streaming import StreamingDataset
from .writepass import IterableWritePass, MapWritePass, owned_cache, wait_for_index

_UNSUPPORTED = ("sampler", "batch_sampler")
MERGE_TIMEOUT_S = 3600.0
STATE_VERSION = 1


def _identity(batch: Any) -> Any:
    return batch


class CacheDataLoader:
    """Iterate a dataset in batches; the first epoch also writes it to a chunked cache.

    Sources:

    * a map-style dataset plus ``cache_dir``: epoch 1 reads the dataset and writes its
      items (each DataLoader worker of each rank its own ``chunk-{writer}-{n}.bin`` and
      ``{writer}.index.json``, merged into ``index.json`` when the epoch ends), in the
      same batch order torch's DataLoader would use. Later epochs, and later processes,
      stream from the cache and never touch the dataset;
    * an ``IterableDataset`` plus ``cache_dir``: the same, keys numbered per writer;
    * a dataset that owns a :class:`Cache` and fills it in ``__getitem__``: the loader
      drives it and finishes its writers; later epochs call the dataset, which reads its
      cache;
    * a :class:`StreamingDataset`, a :class:`Cache`, or the path/URL of a written dataset.

    Batches collate as torch's ``default_collate`` would. Under ``torch.distributed``
    every rank gets the same number of batches. Each ``iter()`` runs the next epoch (or
    choose it with :meth:`set_epoch`); the order of an epoch is reproducible from
    ``seed``. The first (writing) epoch shuffles with a plain permutation; streamed
    epochs use the chunk-aware order of :class:`StreamingDataset`.

    :meth:`state_dict` records what the consumer received, in constant size;
    :meth:`load_state_dict` in a new process continues exactly after it, also with
    another ``num_workers`` or world size (for a streamed epoch; the writing epoch
    resumes with the same world size and workers, re-reading what it skips).

    Args:
        dataset: see above.
        cache_dir: where to write the chunks; for a URL, where to cache them.
        chunk_bytes / chunk_size: chunk limits for writing (see :class:`Cache`).
        compression: ``"zstd"`` to compress large leaf buffers when writing.
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
        compression: str | None = None,
        **kwargs: Any,
    ) -> None:
        for name in _UNSUPPORTED:
            if kwargs.get(name) is not None:
                raise ConfigError(
                    f"CacheDataLoader orders items itself (shuffle, seed); {name}= is not supported"
                )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._stream: StreamingDataset | None = None
        self._owned = False
        if isinstance(dataset, StreamingDataset):
            if shuffle and not dataset.shuffle:
                raise ConfigError(
                    "a StreamingDataset orders its own items: pass shuffle=True (and seed) "
                    "to StreamingDataset, not to CacheDataLoader"
                )
            self._stream = dataset
            self.cache = None
        else:
            if isinstance(dataset, (str, os.PathLike)):
                dataset = Cache(dataset, cache_dir=cache_dir)
            owned = owned_cache(dataset)
            if owned is not None:
                self.cache, self._owned = owned, owned is not dataset
            elif cache_dir is not None:
                self.cache = Cache(
                    cache_dir,
                    chunk_size=chunk_size,
                    chunk_bytes=chunk_bytes,
                    compression=compression,
                )
            else:
                raise ConfigError(
                    "CacheDataLoader needs cache_dir= (where to write the chunks) unless the "
                    "dataset keeps its own Cache"
                )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = self._stream.shuffle if self._stream else shuffle
        self.seed = self._stream.seed if self._stream else seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        self.kwargs = kwargs
        self._epoch = 0  # the epoch the next iter() runs
        self._current = 0  # the epoch running (or last run)
        self._batches = 0  # batches the consumer received in it
        self._writing = False
        self._resume: dict[str, Any] | None = None
        self._check_matches()

    def _check_matches(self) -> None:
        c = self.cache
        if (
            c is not None
            and not self._owned
            and self.dataset is not c
            and isinstance(self.dataset, Sized)
            and c.filled
            and len(self.dataset) != len(c)
        ):
            raise ConfigError(
                f"{c.input_dir} holds {len(c)} items but the dataset has {len(self.dataset)};"
                " delete the directory or choose another cache_dir"
            )

    # -- which path an epoch takes -------------------------------------------------
    def _streaming(self) -> StreamingDataset:
        if self._stream is None:
            assert self.cache is not None
            c = self.cache
            self._stream = StreamingDataset(
                c.url,
                cache_dir=c.cache_dir,
                shuffle=self.shuffle,
                seed=self.seed,
                drop_last=self.drop_last,
                storage_options=c.storage_options,
                max_cache_bytes=c.max_cache_bytes,
                allow_pickle=c.allow_pickle,
            )
        return self._stream

    def _must_write(self) -> bool:
        return self.cache is not None and self._stream is None and not self.cache.filled

    # -- epochs --------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` runs."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._resume = None

    def __len__(self) -> int:
        if self._owned or self._must_write():
            world = distributed.current()
            n = (
                len(self.cache)
                if self.cache is not None and self.cache.filled
                else len(self.dataset)
            )
            per_rank = -(-n // world.world_size)
        else:
            ds = self._streaming()
            ds.batch_size, ds.num_workers = self.batch_size, max(1, self.num_workers)
            per_rank = len(ds)
        if self.drop_last:
            return per_rank // self.batch_size
        return -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        epoch = int(resume["epoch"]) if resume else self._epoch
        self._epoch = epoch + 1
        self._current, self._batches = epoch, 0
        self._writing = self._must_write()
        if self._owned:
            return self._count(self._owned_epoch(epoch))
        if self._must_write():
            skip = int(resume["batches"]) if resume else 0
            return self._count(self._write_epoch(epoch, skip))
        return self._count(self._stream_epoch(epoch, resume))

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._batches += 1  # before the yield: the consumer has it when it resumes us
            yield batch

    def _loader(self, dataset: Any, **kw: Any) -> DataLoader[Any]:
        return DataLoader(dataset, num_workers=self.num_workers, **kw, **self.kwargs)

    def _stream_epoch(self, epoch: int, resume: dict[str, Any] | None) -> Iterator[Any]:
        ds = self._streaming()
        if resume is not None:
            ds.load_state_dict(resume["stream"])
        else:
            ds.set_epoch(epoch)
        ds.batch_size, ds.num_workers = self.batch_size, max(1, self.num_workers)
        yield from self._loader(
            ds, batch_size=self.batch_size, drop_last=self.drop_last, collate_fn=self.collate_fn
        )

    def _owned_epoch(self, epoch: int) -> Iterator[Any]:
        assert self.cache is not None
        if not self.cache.filled:
            yield from self._write_epoch(epoch, 0)
            return
        world = distributed.current()
        sampler = EpochSampler(
            len(self.cache),
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            rank=world.rank,
            world_size=world.world_size,
        )
        yield from self._loader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=self.drop_last,
            collate_fn=self.collate_fn,
        )

    def _write_epoch(self, epoch: int, skip: int) -> Iterator[Any]:
        # Local import: these helpers belong to the writing epoch alone.
        from .writepass import check_claim, claim_directory

        assert self.cache is not None
        world = distributed.current()
        token = None
        lock = None
        if world.rank == 0:
            # The job's write lock, held by this process until index.json is published:
            # another job gets WriteConflictError, and nobody deletes its files.
            lock, token = claim_directory(self.cache.input_dir, secrets.token_hex(8))
            if lock is not None:
                remove_partial(self.cache.input_dir, token)
        token = check_claim(str(distributed.broadcast(token)))
        try:
            nw = max(1, self.num_workers)
            iterable = isinstance(self.dataset, IterableDataset)
            source: IterableDataset[Any]
            if iterable:
                source = IterableWritePass(self.dataset, self.cache, world.rank, nw, token)
                loader = self._loader(
                    source,
                    batch_size=self.batch_size,
                    drop_last=self.drop_last,
                    collate_fn=self.collate_fn,
                )
            else:
                share = rank_share(
                    epoch_order(
                        len(self.dataset), shuffle=self.shuffle, seed=self.seed, epoch=epoch
                    ),
                    world.rank,
                    world.world_size,
                )
                bs = self.batch_size
                batches = [share[i : i + bs] for i in range(0, len(share), bs)]
                leftover: list[tuple[int, bool]] = []
                if self.drop_last and batches and len(batches[-1]) < bs:
                    leftover = batches.pop()
                source = MapWritePass(
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
                loader = self._loader(source, batch_size=None, collate_fn=_identity)
            for i, batch in enumerate(loader):
                if i >= skip:
                    yield batch
                else:
                    self._batches += 1  # received before the restart this resumes
            writers = range(world.world_size * nw)
            # Both waits are bounded by the writers' progress, not by a fixed time.
            if world.rank == 0:
                merge_dir(
                    self.cache.input_dir,
                    writers,
                    token=token,
                    config={"token": token},
                    renumber=iterable,
                )
            else:
                wait_for_index(self.cache.input_dir, token)
        finally:  # also when the consumer abandons the epoch
            if lock is not None:
                lock.release()
        self._writing = False

    # -- resume --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the consumer has received, as of the last batch it got. Constant size."""
        world = distributed.current()
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "epoch": self._current,
            "batches": self._batches,
            "world": world.world_size,
            "num_workers": max(1, self.num_workers),
            "batch_size": self.batch_size,
            "writing": self._writing,
        }
        if self._owned:
            raise ResumeStateError(
                "a dataset that fills its own Cache can't be resumed mid-epoch; pass the "
                "cache directory to CacheDataLoader instead to stream it resumably"
            )
        if not self._writing and not self._must_write():
            ds = self._streaming()
            nw = max(1, self.num_workers)
            ds.batch_size, ds.num_workers = self.batch_size, nw
            received = min(self._batches * self.batch_size, len(ds))
            state["stream"] = ds.state_dict(
                received=received, num_workers=nw, batch_size=self.batch_size
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue exactly after what ``state`` says was received.

        Raises:
            ResumeStateError: the state is from another dataset, seed or shuffle setting,
                or is a writing epoch saved with another world size or worker count.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ResumeStateError("not a CacheDataLoader state")
        if state.get("writing"):
            world = distributed.current()
            if not self._must_write():
                raise ResumeStateError(
                    "the state is from the writing epoch, but this cache is already filled"
                )
            got = (state["world"], state["num_workers"], state["batch_size"])
            want = (world.world_size, max(1, self.num_workers), self.batch_size)
            if got != want:
                raise ResumeStateError(
                    f"the writing epoch resumes only with the same (world size, workers, "
                    f"batch size): state has {got}, this loader {want}"
                )
            self._resume = dict(state)
            return
        if "stream" not in state:
            raise ResumeStateError("the state has no streaming position")
        ds = self._streaming()
        ds.load_state_dict(state["stream"])  # validates the dataset, seed and shuffle
        self._resume = {"epoch": ds.epoch, "stream": state["stream"]}
