"""``CacheDataLoader``: the first epoch writes the dataset to chunks, later epochs stream them."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, default_collate

from ..config import Settings
from ..errors import ConfigError, ResumeStateError
from ..sampling.state import check_loader_state
from ..sampling.steps import Skips
from . import distributed
from .cache import Cache
from .epoch import EpochDataset
from .handover import HandedOver
from .loader_state import STATE_VERSION as STATE_VERSION  # (importable here as before)
from .loader_state import base_state, check_map_settings, loaded_skips, map_resume, stream_received
from .loader_stats import LoaderStats
from .map_order import ByKey, EpochSampler, map_batch_count, map_batches
from .received import EpochBatches
from .streaming import StreamingDataset
from .workers import close_iterator, lazy, led_or_lazy
from .writepass import WriteOrder, identity, owned_cache, write_pass

_UNSUPPORTED = ("sampler", "batch_sampler")
# torch DataLoader arguments the inner loaders take from this one's attributes.
_PASSED = (
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "pin_memory_device",
    "in_order",
)


class CacheDataLoader(DataLoader[Any]):
    """Iterate a dataset in batches; the first epoch also writes it to a chunked cache.

    A ``torch.utils.data.DataLoader`` subclass: it is accepted wherever a DataLoader is
    (Lightning, ``accelerate``...), and its attributes (``dataset``, ``batch_size``,
    ``num_workers``, ``persistent_workers``...) are the DataLoader's. It runs its own
    epoch planning: :meth:`__iter__` starts the next epoch through inner DataLoaders.
    With ``persistent_workers=True`` the streamed epochs keep the same worker processes;
    each epoch's plan reaches them through memory the dataset shares with its workers.

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
    * a :class:`StreamingDataset` (also one with ``subsample=`` / ``epoch_size=``, or a
      :class:`~asynccache.MixedDataset` of several), a :class:`Cache`, or the path/URL of
      a written dataset.

    Batches collate as torch's ``default_collate`` would. Under ``torch.distributed``
    every rank gets the same number of batches. Each ``iter()`` runs the next epoch (or
    choose it with :meth:`set_epoch`); the order of an epoch is reproducible from
    ``seed``. The first (writing) epoch shuffles with a plain permutation; streamed
    epochs use the chunk-aware order of :class:`StreamingDataset`.

    :meth:`state_dict` records what the consumer received, in constant size;
    :meth:`load_state_dict` in a new process continues exactly after it, also with
    another ``num_workers`` or world size (for a streamed epoch; the writing epoch
    resumes with the same world size and workers, re-reading what it skips, or, once
    its cache has merged, reads the rest of its order from the cache). A state taken
    before an epoch's first batch is that epoch's start; one taken after its last
    batch (with ``drop_last``: its last full batch) resumes with the next epoch.

    Steps (streamed epochs; docs/parallelism.md): a step is one batch this loader
    delivers, counted from epoch 0's first (each epoch has :attr:`steps_per_epoch`).
    :meth:`seek` continues at any step's batch without reading the batches before it;
    :meth:`skip` never delivers a range of steps (their samples are dropped for that
    epoch), and the state remembers it. Over a dataset split over data-parallel ranks
    (``data_parallel=`` / ``replication=``), batches, lengths and states count per DP
    rank.

    Args:
        dataset: see above.
        cache_dir: where to write the chunks; for a URL, where to cache them.
        chunk_bytes / chunk_size: chunk limits for writing (see :class:`Cache`).
        compression: ``"zstd"`` to compress large leaf buffers when writing.
        batch_size, num_workers, shuffle, drop_last, collate_fn: as torch's DataLoader.
        seed: the shuffle seed (default 0). A :class:`StreamingDataset` has its own: pass
            it there; a different one here raises ``ConfigError``.
        **kwargs: passed to torch's DataLoader (``pin_memory``, ``timeout``,
            ``multiprocessing_context``, ``worker_init_fn``, ``prefetch_factor``,
            ``persistent_workers``...).
    """

    def __init__(
        self,
        dataset: Any,
        cache_dir: str | os.PathLike[str] | None = None,
        chunk_bytes: int | str | None = None,
        chunk_size: int | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        compression: str | None = None,
        **kwargs: Any,
    ) -> None:
        for name in _UNSUPPORTED:
            if kwargs.pop(name, None) is not None:
                raise ConfigError(
                    f"CacheDataLoader orders items itself (shuffle, seed) and splits them over "
                    f"ranks; {name}= is not supported (with Lightning's DDP: "
                    "Trainer(use_distributed_sampler=False))"
                )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._stream: EpochDataset | None = None
        self._owned = False
        self._stream_loader: DataLoader[Any] | None = None  # kept for persistent workers
        if isinstance(dataset, EpochDataset):
            if shuffle and not dataset.shuffle:
                raise ConfigError(
                    "a StreamingDataset orders its own items: pass shuffle=True (and seed) "
                    "to StreamingDataset, not to CacheDataLoader"
                )
            if seed is not None and seed != dataset.seed:
                raise ConfigError(
                    f"a StreamingDataset orders its own items with its own seed "
                    f"({dataset.seed}); seed={seed} here would be ignored: pass seed={seed} "
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
        super().__init__(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=collate_fn or default_collate,
            **kwargs,
        )
        self._bs: int = batch_size  # (DataLoader types batch_size as optional)
        self.shuffle = self._stream.shuffle if self._stream else shuffle
        self.seed = self._stream.seed if self._stream else (seed or 0)
        self._epoch = 0  # the epoch the next iter() runs
        self._current = 0  # the epoch running (or last run)
        self._writing = False
        # The epoch started by the latest iter(); None: none since construction,
        # set_epoch() or load_state_dict(). Its `received` is what state_dict reports.
        self._it: EpochBatches | None = None
        # Batches of the running streamed epoch received before its loaded state: the
        # state's count is of the whole epoch, the dataset's position of the part.
        self._part_base = 0
        self._resume: dict[str, Any] | None = None  # a loaded position, for the next iter()
        self._loaded: dict[str, Any] | None = None  # the state it came from, as loaded
        # Why streamed epochs collate items here instead of taking whole batches from the
        # workers (None: whole batches; set when the first streamed epoch starts).
        self.batch_fallback: str | None = None
        self._skips = Skips()  # steps never delivered (see skip())
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

    @property
    def stats(self) -> LoaderStats:
        """Download statistics summed over this process and every worker, and the local
        cache's occupancy. Add a Fetcher's stall figures with
        ``loader.stats.with_stall(fetcher.stats)``."""
        ds = self._stream
        if ds is None and self.cache is not None and self.cache.filled:
            ds = self._streaming()
        if ds is None:  # the writing epoch reads the dataset itself: nothing downloaded
            budget = Settings.from_env(
                max_cache_bytes=self.cache.max_cache_bytes if self.cache else None
            ).max_cache_bytes
            return LoaderStats(cache_budget=budget)
        totals = ds.download_stats()
        cached, budget = ds.cache_usage()
        return LoaderStats(
            bytes=int(totals["bytes"]),
            chunks_fetched=int(totals["chunks_fetched"]),
            hits=int(totals["hits"]),
            misses=int(totals["misses"]),
            retries=int(totals["retries"]),
            wait_s=totals["wait_s"],
            cached_bytes=cached,
            cache_budget=budget,
        )

    # -- which path an epoch takes -------------------------------------------------
    def _streaming(self) -> EpochDataset:
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
        """The epoch the next ``iter()`` runs (after ``load_state_dict``: the one it resumes)."""
        r = self._resume
        if r is None:
            return self._epoch
        return int(r["epoch"]) + (1 if r.get("complete") else 0)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run ``epoch`` from its start (drops a loaded state)."""
        self._epoch = epoch
        self._resume = self._loaded = None
        self._it = None

    def __len__(self) -> int:
        """Batches of the epoch the loader runs (or the next ``iter()`` runs), whole: for a
        resumed epoch, those received before the state plus the rest. (Lightning counts
        a resumed epoch's batches from the checkpoint's batch index up to this.)"""
        r = self._resume
        if r is not None and r.get("writing") and not r.get("complete"):
            # A map-order epoch (counted only for a map-style source).
            world = distributed.current()
            n = r.get("items")
            if n is not None:
                return map_batch_count(n, world.world_size, self._bs, self.drop_last)
        before = 0
        loaded = self._loaded
        if r is not None and loaded is not None and not r.get("writing"):
            if int(loaded["epoch"]) == int(r["epoch"]):  # else the loaded epoch was over
                before = int(loaded["batches"])
        elif r is None and self._it is not None and not self._it.map_order:
            before = self._part_base
        if self._owned or self._must_write():
            world = distributed.current()
            n = (
                len(self.cache)
                if self.cache is not None and self.cache.filled
                else len(self.dataset)  # type: ignore[arg-type]
            )
            per_rank = -(-n // world.world_size)
        else:
            ds = self._streaming()
            self._configure(ds)
            per_rank = len(ds)
        ahead = 0  # skipped steps still ahead in this epoch
        if self._skips and not (self._owned or self._must_write()):
            steps = ds.steps_per_epoch()
            it = self._it
            if r is None and it is not None and it.ended:  # the next iter() runs the next
                first = self._epoch * steps
                return steps - self._skips.count(first, first + steps)
            first = ds.epoch * steps
            ahead = self._skips.count(first + ds.batch_now(), first + steps)
        if self.drop_last:
            return before + per_rank // self._bs - ahead
        return before + -(-per_rank // self._bs) - ahead

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Start the next epoch (or the loaded position) and return its batches.

        Everything a checkpoint depends on is set up here, not at the first batch: a
        state taken between ``iter()`` and the first batch is the start of this epoch.
        """
        if self._stream is not None:
            self._stream.check_reads()
        resume, loaded = self._resume, self._loaded
        self._resume = self._loaded = None
        if self._it is not None:  # a superseded epoch counts nothing any more
            self._it.close()
        epoch = int(resume["epoch"]) if resume else self._epoch
        self._writing = self._must_write()
        if resume is not None and resume.get("writing"):
            skip = int(resume["batches"])
            if resume.get("complete") and self._writing:
                # Every batch was received but the cache never merged: write it without
                # handing anything out, then run the next epoch.
                self._begin(epoch, True, skip)
                assert self._it is not None
                return self._it.run(self._write_then_stream(self._it, epoch, skip))
            if resume.get("complete"):
                epoch, resume = epoch + 1, None  # nothing left of it: the next epoch
            elif self._writing:
                return self._begin(epoch, True, skip).run(self._write_epoch(epoch, skip))
            else:  # merged since the state was taken: read the rest from the cache
                return self._begin(epoch, True, skip).run(self._tail_epoch(epoch, skip))
        if self._owned:
            return self._begin(epoch, False, 0).run(self._owned_epoch(epoch))
        if self._writing:
            return self._begin(epoch, True, 0).run(self._write_epoch(epoch, 0))
        base = 0  # batches of this epoch received before the loaded state
        if resume is not None and loaded is not None and int(loaded["epoch"]) == epoch:
            base = int(loaded["batches"])
        it = self._begin(epoch, False, base)
        self._part_base = base
        return it.run(self._stream_epoch(epoch, resume))

    def _begin(self, epoch: int, map_order: bool, received: int) -> EpochBatches:
        self._epoch = epoch + 1
        self._current = epoch
        self._part_base = 0
        self._it = EpochBatches(epoch, map_order, received)
        return self._it

    def _loader(self, dataset: Any, persistent: bool = False, **kw: Any) -> DataLoader[Any]:
        """An inner DataLoader with this one's settings (persistent workers only for the
        streamed epochs, whose loader is kept)."""
        for name in _PASSED:
            kw[name] = getattr(self, name)
        if self.num_workers > 0:
            kw["prefetch_factor"] = self.prefetch_factor
            kw["persistent_workers"] = persistent
        else:
            kw["multiprocessing_context"] = None
        return DataLoader(dataset, num_workers=self.num_workers, **kw)

    def _stream_epoch(self, epoch: int, resume: dict[str, Any] | None) -> Iterator[Any]:
        """Position the dataset now (so a state taken before the first batch is right);
        the DataLoader starts at the first batch."""
        ds = self._streaming()
        self._configure(ds)
        loader = self._stream_loader
        if loader is None:
            self.batch_fallback = self._batch_fallback(ds)
        # Whole batches from the workers, or items collated here (docs/streaming.md).
        ds.set_batch_mode(self.drop_last if self.batch_fallback is None else None)
        if resume is not None:
            ds.load_state_dict(resume["stream"])
        else:
            ds.set_epoch(epoch)
        if not self._land(ds, epoch):  # the rest of this epoch is skipped
            return iter(())
        if loader is None:
            if self.batch_fallback is None:
                loader = self._loader(
                    ds, persistent=self.persistent_workers, batch_size=None, collate_fn=identity
                )
            else:
                loader = self._loader(
                    ds,
                    persistent=self.persistent_workers,
                    batch_size=self._bs,
                    drop_last=self.drop_last,
                    collate_fn=HandedOver(self.collate_fn),
                )
            if self.persistent_workers:
                self._stream_loader = loader
            if self._leads(ds):
                return self._skipping(ds, epoch, loader, led_or_lazy(ds.first_batches, loader))
        return self._skipping(ds, epoch, loader, lazy(loader))

    def _configure(self, ds: EpochDataset) -> None:
        """Tell the dataset how this loader consumes it (what its steps are)."""
        ds.batch_size, ds.num_workers = self._bs, max(1, self.num_workers)
        ds.batch_drop_last = self.drop_last

    def _land(self, ds: EpochDataset, epoch: int, at: int | None = None) -> bool:
        """Move the dataset past the skipped steps the consumer stands at (step ``at``;
        None: where the dataset's part starts); False when they reach past the end of
        ``epoch``, which then delivers nothing more."""
        if not self._skips:
            return True
        steps = ds.steps_per_epoch()
        if at is None:
            at = epoch * steps + ds.batch_now()
        land = self._skips.landing(at)
        if land == at or not steps:
            return True
        # Batches delivered so far in this epoch: what the dataset's new part follows.
        it = self._it
        self._part_base = it.received if it is not None and it.epoch == epoch else 0
        # Past the epoch: the dataset stands at the next epoch's start (where a state
        # taken now resumes); the next iter() runs it, landing again if need be.
        ds.load_state_dict(ds.state_for_step(min(land, (epoch + 1) * steps)))
        return land < (epoch + 1) * steps

    def _skipping(
        self, ds: EpochDataset, epoch: int, loader: DataLoader[Any], batches: Iterator[Any]
    ) -> Iterator[Any]:
        """``batches`` until the consumer reaches a skipped step; then the workers stop
        and the epoch goes on from the first step after the skipped ones, or ends if
        they reach past it. Skips added meanwhile count from the next batch."""
        steps = ds.steps_per_epoch()
        at = epoch * steps + ds.batch_now()
        try:
            while True:
                if steps and self._skips.landing(at) != at:
                    close_iterator(batches)  # (its workers end here: the next part starts anew)
                    if not self._land(ds, epoch, at):
                        return
                    at = epoch * steps + ds.batch_now()
                    batches = lazy(loader)
                    continue
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                at += 1
                yield batch
        finally:
            close_iterator(batches)

    def _leads(self, ds: EpochDataset) -> bool:
        """This epoch's first batches are built here while the new workers start (whole
        batches from the workers of a StreamingDataset or a mix; docs/streaming.md)."""
        return self.num_workers > 0 and self.batch_fallback is None and ds.settings.first_batch_here

    def _batch_fallback(self, ds: EpochDataset) -> str | None:
        """Why the streamed epochs collate items in the loader rather than take whole
        batches from the workers (None: they take whole batches)."""
        if self.collate_fn is not default_collate:
            return "a collate_fn is set"
        return ds.batchable()

    def _map_batches(self, epoch: int, n: int) -> list[list[int]]:
        world = distributed.current()
        return map_batches(
            n,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            rank=world.rank,
            world_size=world.world_size,
            batch_size=self._bs,
            drop_last=self.drop_last,
        )

    def _tail_epoch(self, epoch: int, skip: int) -> Iterator[Any]:
        """The batches after the first ``skip`` of writing epoch ``epoch``, in its order,
        read back from the filled cache (the dataset is not touched)."""
        ds = self._streaming()
        rest = self._map_batches(epoch, ds.num_items)[skip:]
        return lazy(self._loader(ByKey(ds), batch_sampler=rest, collate_fn=self.collate_fn))

    def _write_then_stream(self, it: EpochBatches, epoch: int, skip: int) -> Iterator[Any]:
        for _ in self._write_epoch(epoch, skip):  # every batch is skipped: nothing comes
            pass
        nxt = self._stream_epoch(epoch + 1, None)
        self._epoch, self._current = epoch + 2, epoch + 1
        it.restart(epoch + 1, map_order=False)
        yield from nxt

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
        loader = self._loader(
            self.dataset,
            batch_size=self._bs,
            sampler=sampler,
            drop_last=self.drop_last,
            collate_fn=self.collate_fn,
        )
        yield from lazy(loader)

    def _write_epoch(self, epoch: int, skip: int) -> Iterator[Any]:
        assert self.cache is not None
        yield from write_pass(
            self.dataset,
            self.cache,
            WriteOrder(epoch, skip, self.shuffle, self.seed, self._bs, self.drop_last),
            owned=self._owned,
            num_workers=max(1, self.num_workers),
            collate_fn=self.collate_fn,
            make_loader=self._loader,
        )
        self._writing = False

    # -- resume --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the consumer has received, as of the last batch it got. Constant size.

        * Between ``iter()`` and the first batch: the start of that epoch.
        * Before any ``iter()`` (or after ``set_epoch``): the start of :attr:`epoch`;
          right after ``load_state_dict``: the loaded position.
        * After an epoch's last batch (with ``drop_last``: its last full batch): an
          epoch with nothing left, which resumes with the next epoch.
        * During the writing epoch (or its rest read back from the cache), the state
          has ``writing=True`` and counts batches of the writing epoch's order.
        """
        if self._owned:
            raise ResumeStateError(
                "a dataset that fills its own Cache can't be resumed mid-epoch; pass the "
                "cache directory to CacheDataLoader instead to stream it resumably"
            )
        if self._resume is not None and self._loaded is not None:
            loaded = copy.deepcopy(self._loaded)
            if self._skips:  # (with any skip() since the load)
                loaded["skips"] = self._skips.to_json()
            return loaded
        it = self._it
        if it is None:  # no epoch started: the start of the next one
            if self._must_write():
                return self._map_state(self._epoch, 0)
            self._streaming().set_epoch(self._epoch)
            return self._stream_state(self._epoch, 0, 0)
        epoch, map_order, received = it.epoch, it.map_order, it.received
        if map_order:
            return self._map_state(epoch, received)
        return self._stream_state(epoch, received, self._part_base)

    def _base_state(self, epoch: int, batches: int, writing: bool) -> dict[str, Any]:
        return base_state(
            epoch,
            batches,
            writing,
            world=self._world_size(),
            num_workers=max(1, self.num_workers),
            batch_size=self._bs,
            skips=self._skips,
        )

    def _world_size(self) -> int:
        """The ranks batches are counted over: a streamed dataset's data-parallel size."""
        if self._stream is not None:
            return self._stream.dp_rank_and_world()[1]
        return distributed.current().world_size

    # -- steps ---------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Batches a whole streamed epoch has for the consumer of each (data-parallel)
        rank, skipped ones included: step ``S`` is batch ``S % steps_per_epoch`` of epoch
        ``S // steps_per_epoch``."""
        ds = self._seekable()
        return ds.steps_per_epoch()

    def _seekable(self) -> EpochDataset:
        if self._owned or self._must_write():
            raise ConfigError(
                "steps are batches of streamed epochs: this loader's next epoch writes the "
                "cache (or its dataset fills its own Cache); seek and skip once the cache "
                "is written, or stream it with a StreamingDataset"
            )
        ds = self._streaming()
        self._configure(ds)
        return ds

    def state_for_step(self, step: int) -> dict[str, Any]:
        """The state an uninterrupted run of this loader saves after ``step`` batches
        (counted from epoch 0's first batch, skipped steps included; a step inside a
        skipped range is the first after it). Reads nothing; its cost does not grow with
        ``step``.

        Raises:
            ConfigError: a negative or non-integer step; a loader whose next epoch writes
                the cache.
        """
        ds = self._seekable()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an integer >= 0, got {step!r}")
        land = self._skips.landing(step)
        stream = ds.state_for_step(land)
        steps = ds.steps_per_epoch()
        epoch = land // steps
        delivered = land - epoch * steps - self._skips.count(epoch * steps, land)
        state = self._base_state(epoch, delivered, False)
        state["stream"] = stream
        return state

    def seek(self, step: int) -> None:
        """Make the next ``iter()`` continue at step ``step``'s batch (see
        :meth:`state_for_step`), as after ``load_state_dict``: without reading the
        batches in between, at a cost that does not grow with ``step``."""
        self.load_state_dict(self.state_for_step(step))

    def skip(self, start_step: int, end_step: int) -> None:
        """Never deliver the batches of steps ``[start_step, end_step)`` (the batches
        around a loss spike, say): a consumer that reaches ``start_step`` gets
        ``end_step``'s batch next (the workers restart there: nothing in between is
        read). The skipped samples are dropped for their epoch, not read later; steps
        keep their numbers. The range is part of :meth:`state_dict`, so a resumed run
        skips it too, and a loaded state's ranges add to this loader's. Takes effect
        from the next batch, also mid-epoch.

        Raises:
            ConfigError: not integers with ``0 <= start_step < end_step``.
        """
        for v in (start_step, end_step):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"skip() takes integer steps, got {v!r}")
        try:
            self._skips = self._skips.add(start_step, end_step)
        except ValueError as exc:
            raise ConfigError(f"skip({start_step}, {end_step}): {exc}") from exc

    @property
    def skips(self) -> list[tuple[int, int]]:
        """The ranges of steps this loader never delivers (merged)."""
        return list(self._skips.ranges)

    def _iterable_source(self) -> bool:
        """The writing epoch reads an ``IterableDataset`` (its order is its own)."""
        return isinstance(self.dataset, IterableDataset) and not isinstance(
            self.dataset, EpochDataset
        )

    def _map_items(self) -> int | None:
        """Items of the map-order epoch; None for an ``IterableDataset`` being written."""
        if not self._must_write():
            return self._streaming().num_items
        if isinstance(self.dataset, IterableDataset) or not isinstance(self.dataset, Sized):
            return None
        return len(self.dataset)

    def _map_state(self, epoch: int, batches: int) -> dict[str, Any]:
        state = self._base_state(epoch, batches, True)
        iterable = self._iterable_source()
        state.update(
            items=self._map_items(),
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            source="iterable" if iterable else "map",
        )
        return state

    def _stream_state(self, epoch: int, batches: int, base: int) -> dict[str, Any]:
        ds = self._streaming()
        nw = max(1, self.num_workers)
        self._configure(ds)
        left = len(ds)  # what this rank had still to receive when the epoch (part) began
        received = stream_received(left, batches - base, self._bs, self.drop_last)
        state = self._base_state(epoch, batches, False)
        state["stream"] = ds.state_dict(received=received, num_workers=nw, batch_size=self._bs)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue exactly after what ``state`` says was received.

        Raises:
            ResumeStateError: the state is from another dataset, seed or shuffle setting,
                or is a writing epoch saved with another world size or worker count.
        """
        if self._owned:
            raise ResumeStateError("a dataset that fills its own Cache can't be resumed")
        streamed = isinstance(state, dict) and state.get("writing") is False
        ds = self._streaming() if streamed and not self._must_write() else None
        pos = check_loader_state(
            state,
            identity=None if ds is None else {"item_loader": None, **ds.identity()},
            epoch_total=None if ds is None else ds.epoch_total,
            drop_last=self.drop_last,
            seed=self.seed,
            shuffle=self.shuffle,
            extra=() if ds is None else ds.STATE_EXTRA,
        )
        state = pos.state
        skips = loaded_skips(self._skips, state, world=self._world_size(), batch_size=self._bs)
        if pos.writing:
            resume = self._load_map_state(state)
        else:
            if "stream" not in state:
                raise ResumeStateError("the state has no streaming position")
            ds = self._streaming()
            ds.load_state_dict(state["stream"])  # validates the dataset, seed and shuffle
            resume = {"epoch": ds.epoch, "stream": state["stream"]}
        if self._it is not None:  # the running epoch is over for the consumer
            self._it.close()
            self._it = None
        self._skips = skips
        self._resume, self._loaded = resume, copy.deepcopy(state)

    def _load_map_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Check a writing-epoch state against this loader; where the next iter() goes
        (see :func:`~asynccache.torch.loader_state.map_resume`)."""
        check_map_settings(state, seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last)
        return map_resume(
            state,
            drop_last=self.drop_last,
            writes=self._must_write(),
            iterable=self._iterable_source(),
            world=distributed.current().world_size,
            num_workers=max(1, self.num_workers),
            batch_size=self._bs,
            items=self._map_items,
        )
