"""``StreamingDataset``: stream a written dataset from any URL, in a reproducible order."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import default_collate, default_convert, get_worker_info

from ..cache.usage import scan
from ..config import Settings
from ..errors import ConfigError, ResumeStateError
from ..read.batchread import OBJECT_KINDS, Form, Leaf, assemble_into, bytes_needed
from ..read.reader import Reader
from ..read.readplan import EpochSpec, ReaderPlace, View
from ..read.source import DatasetSource
from ..read.source_units import SourceReader, SourceUnits, UnitSource
from ..read.sources import open_source
from ..read.token_blocks import TokenBlocks, TokenUnits
from ..read.units import UnitReader
from ..read.verified import ROW, VerifiedFiles
from ..sampling import Plan, Segment
from ..sampling.order import ItemUnits, OrderSpec, ReadOrder, Units
from ..sampling.progress import Progress
from . import batches, distributed
from .epoch import BLOCK, EpochDataset
from .lead import HeadStart, workers_first_chunks
from .shared_epoch import STAT_FIELDS, shared_bytes

__all__ = ["StreamingDataset", "reader_place"]

log = logging.getLogger(__name__)
_LOOKAHEAD = 8192  # positions scanned at a time when looking for the next chunks
# A link is far when its first byte takes at least this long, as this process measured it
# (the index's column sidecar, the first batches' range reads): there the first batches
# built in the main process wait on the network, not on the CPU, and the DataLoader's
# workers are started beside them at once (see workers.led).
_FAR_TTFB_S = 0.02
# Lead batches of this many bytes or more, all in cached chunks, take longer to copy than
# the workers' forks (10-30 ms each): those fork first (docs/streaming.md).
_FORK_FIRST_BYTES = 32 << 20
# Rows of a local dataset's table of verified chunk files (48 bytes each, shared memory):
# a chunk past it shares a row, and may be hashed again by another worker.
_VERIFIED_ROWS = 16384


def _numpy(t: Any) -> np.ndarray:
    """The numpy view of shared tensor ``t`` (:class:`~..read.verified.VerifiedFiles`)."""
    return t.numpy()


def reader_place(
    pr: Progress, total: int, world: distributed.World, logical: int, drop_last: bool
) -> ReaderPlace:
    """Where reader ``logical`` of this rank stands in the node's epoch ``pr``."""
    return ReaderPlace(
        epoch=pr.epoch,
        remaining=tuple(pr.base(total)),
        received=pr.received,
        world=world.world_size,
        rank=world.rank,
        num_workers=pr.num_workers,
        worker=logical,
        batch_size=pr.batch_size,
        drop_last=drop_last,
        nodes=world.nodes,
    )


class StreamingDataset(EpochDataset):
    """Items of a written dataset, streamed in sampler order with chunks fetched ahead.

    Opening reads only ``index.json``. Iterating, each DataLoader worker of each rank
    reads its own contiguous part of the epoch order (whole chunks, or whole windows of
    chunks when shuffling), telling the downloader which chunks come next so they arrive
    before they are needed, and releasing chunks to the cache's LRU once read.

    The order of epoch ``e`` is a pure function of (dataset, ``seed``, ``e``, world size,
    workers, batch size): identical on every rerun, different for the next epoch. Each
    new ``iter()`` runs the next epoch (0, 1, 2, ...) unless :meth:`set_epoch` named the
    epoch it runs, whether the dataset is iterated directly, through a plain
    ``torch.utils.data.DataLoader`` (also with ``persistent_workers=True``) or through
    ``CacheDataLoader`` (which also tracks what was consumed, for resume).

    Under ``torch.distributed`` (or ``RANK``/``WORLD_SIZE`` with a launched group) every
    rank yields the same number of samples, so DDP never hangs: with ``drop_last=True``
    the remainder is dropped; otherwise ranks are padded by repeating the epoch's first
    samples, like ``DistributedSampler``. Under model parallelism the epoch is split over
    the data-parallel ranks instead (``data_parallel=`` / ``replication=``): the ranks of
    one model replica receive the same batches (docs/parallelism.md).

    ``len(ds)`` is the number of samples this rank yields per epoch; ``ds[i]`` returns
    the item written under key ``i`` (``0 <= i < ds.num_items``), fetching its chunk on
    demand.

    Args:
        input_dir: a local directory or a URL (``s3://``, ``http(s)://``, ``file://``).
        cache_dir: local cache for remote chunks (default ``ASYNCCACHE_CACHE_DIR``).
        shuffle: mix chunks and, within windows of ``shuffle_window`` chunks, items.
        seed: the shuffle seed.
        drop_last: drop the samples that don't divide evenly over ranks (default False:
            pad instead).
        max_cache_bytes: cache budget (default ``ASYNCCACHE_MAX_CACHE_BYTES``).
        transform: applied to each item in the worker.
        storage_options: endpoint, credentials and TLS options.
        batch_size: the consumer's batch size; ``CacheDataLoader`` sets it. With a plain
            DataLoader, setting it keeps every batch but the last full and the batches in
            a resumable order.
        shuffle_window: chunks mixed together when shuffling.
        subsample: read only a seeded subset of whole chunks holding about this fraction
            of the items (``0 < subsample <= 1``), the same subset on every rank and in
            every epoch; only those chunks are downloaded.
        epoch_size: samples per epoch over all ranks (None: one pass over the items, or
            over the subsample). Fewer truncates each epoch; more wraps into a further
            pass over the data, shuffled anew.
        item_loader: how a sample is read. None: one sample per written item.
            ``TokenBlocks(block_size=L)`` (a dataset written with ``tokens=``): a sample
            is a block of ``L`` tokens of the concatenated documents (docs/tokens.md);
            ``num_items``, ``len()``, ``ds[i]``, shuffle, split and resume count blocks.
        data_parallel: ``(dp_rank, dp_size)`` or this rank's data-parallel process group:
            the epoch is split over the DP ranks, and every rank of one DP rank (a
            tensor- or sequence-parallel group) reads the same batches. None: the
            global rank and world size.
        replication: consecutive groups of ``replication`` global ranks read the same
            data (instead of ``data_parallel``).
        reads: False for a rank that reads no data (a pipeline stage after the first):
            opening reads ``index.json`` only, nothing else is ever fetched; ``len()``,
            ``state_dict()`` and ``load_state_dict()`` work; iterating raises
            ``ConfigError``.
        columns: read ``input_dir`` as Parquet files, these columns only (docs/sources.md).
            A URL without ``index.json``, an ``hf://datasets/...`` URL, or ``files=`` a glob
            of ``.parquet`` files is read as Parquet too, all columns by default.
        files: a glob (``"**/*.jpg"``): read the files under ``input_dir`` that match it,
            one item per file, without conversion.
        decode: with ``files=``, ``decode(key, data)`` (``decode(key, data, label)`` with
            ``labels=``) makes the item of each file, in the worker; default a dict of
            ``key``, ``data`` (and ``label``).
        labels: with ``files=``, where labels come from: ``"dir"`` (the file's folder
            name, numbered in sorted order) or the key of a side file under
            ``input_dir`` (JSON ``{key: label}``, or CSV ``key,label`` lines).
        refresh: list the source's files again instead of using the cached listing
            (folders of files) or footers (Parquet).
    """

    STATE_EXTRA = ("window",)  # the shuffle window a shuffled epoch is read with

    def __init__(
        self,
        input_dir: str | os.PathLike[str],
        cache_dir: str | os.PathLike[str] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool | None = None,
        max_cache_bytes: int | str | None = None,
        transform: Callable[[Any], Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        batch_size: int = 1,
        shuffle_window: int = 4,
        subsample: float | None = None,
        epoch_size: int | None = None,
        allow_pickle: bool = False,
        settings: Settings | None = None,
        item_loader: TokenBlocks | None = None,
        data_parallel: Any = None,
        replication: int | None = None,
        reads: bool = True,
        columns: list[str] | None = None,
        files: str | None = None,
        decode: Callable[..., Any] | None = None,
        labels: Any = None,
        refresh: bool = False,
    ) -> None:
        self.order_spec = _order_spec(seed, shuffle, shuffle_window, subsample, epoch_size)
        settings = settings or Settings.from_env(max_cache_bytes=max_cache_bytes)
        self.source: DatasetSource = open_source(
            input_dir,
            columns=columns,
            files=files,
            decode=decode,
            labels=labels,
            refresh=refresh,
            cache_dir=cache_dir,
            storage_options=storage_options,
            settings=settings,
        )
        self.index = self.source.index
        self.shuffle = shuffle
        self.seed = seed
        self.transform = transform
        self.shuffle_window = shuffle_window
        self.subsample, self.epoch_size = subsample, epoch_size
        self.units: Units = ItemUnits(self.index)
        self.item_loader = item_loader
        blocks: TokenUnits | None = None
        if item_loader is not None:
            if not isinstance(item_loader, TokenBlocks):
                raise ConfigError(f"item_loader must be a TokenBlocks, got {item_loader!r}")
            self.units = blocks = item_loader.bind(self.index, self.source.url)
        self._check_order()
        # Chunks a reader keeps mapped: in order it reads one chunk, and a batch or a
        # token block may straddle the next; shuffled, a window is read at once, and a
        # batch may straddle the next window. More would only keep mapped pages resident
        # (a worker's memory) and chunks pinned.
        open_chunks = shuffle_window + 2 if shuffle else 2
        self.reader = Reader(
            self.index,
            self.source.acquire,
            release=self.source.release,
            ranged=self.source,
            verify=not self.source.remote,
            allow_pickle=allow_pickle,
            max_open=open_chunks,
        )
        self.unit_reader = UnitReader(self.index, self.reader, self.source, blocks, open_chunks)
        if isinstance(self.source, UnitSource):  # Parquet row groups, packs of files
            if blocks is not None:
                raise ConfigError(f"{self.source.url}: item_loader is for written datasets")
            self.reader = SourceReader(self.index, self.source, open_chunks)  # type: ignore[assignment]
            self.unit_reader = SourceUnits(self.index, self.reader, self.source, open_chunks)  # type: ignore[arg-type]
        elif not self.source.remote:  # chunks hashed once for the dataset and its workers
            rows = max(1, min(self.index.num_chunks, _VERIFIED_ROWS))
            self.reader.shared_verified = VerifiedFiles(shared_bytes(rows * ROW * 8), _numpy)
        self._heads = HeadStart(self.source, self.index, settings)
        # (block keys, their chunks, their positions): see _located_ahead
        self._ahead_memo: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        super().__init__(
            settings,
            bool(drop_last),
            batch_size,
            self.source.url,
            data_parallel=data_parallel,
            replication=replication,
            reads=reads,
        )

    # -- size and random access ----------------------------------------------------
    @property
    def num_items(self) -> int:
        """Items (with ``item_loader=TokenBlocks``: blocks) the dataset holds."""
        blocks = self.unit_reader.blocks
        return len(blocks) if blocks is not None else self.index.total_items

    @property
    def epoch_total(self) -> int:
        """Positions of one epoch over all ranks (``epoch_size``, else the units read)."""
        return self._order().total

    def _check_order(self) -> None:
        try:
            ReadOrder(self.units, self.order_spec, 0)
        except ValueError as exc:
            raise ConfigError(f"{self.source.url}: {exc}") from exc

    def __getitem__(self, key: int) -> Any:
        item = self.unit_reader.read(int(key))
        return self.transform(item) if self.transform else item

    def _order(self) -> ReadOrder:
        """This epoch's order as read (the same the node's read plan is built from)."""
        order = self.__dict__.get("_order_cache")
        spec = self._fitted_order()
        if order is None or order.epoch != self._progress.epoch or order.spec != spec:
            order = ReadOrder(self.units, spec, self._progress.epoch)
            self.__dict__["_order_cache"] = order
        return order

    # -- the shuffle window under the cache budget ---------------------------------------
    def _fitted_order(self, pr: Progress | None = None) -> OrderSpec:
        """The order spec with the shuffle window the node reads with: the requested one,
        or the largest smaller one whose plan fits the cache budget
        (:meth:`DatasetSource.fit_window`), chosen once per (ranks, workers, batch size)
        and kept; a resumed state's window (:meth:`_load_extra`) wins, if the budget
        holds it. ``pr``: the epoch part to fit for (default: this process's)."""
        spec = self.order_spec
        if not spec.shuffle or spec.window <= 1 or not self.source.remote:
            return spec
        world = self._world()
        if pr is not None:
            ranks, workers, batch = pr.world, max(1, pr.num_workers), pr.batch_size
        else:
            workers = max(1, self.num_workers or world.num_workers)
            ranks, batch = world.world_size, self.batch_size
        key = (ranks, workers, batch)
        windows: dict[tuple[int, int, int], int] = self.__dict__.setdefault("_windows", {})
        window = windows.get(key)
        if window is None:
            place = ReaderPlace(
                epoch=self._progress.epoch,
                remaining=(),
                received=0,
                world=ranks,
                rank=min(world.rank, ranks - 1),
                num_workers=workers,
                worker=0,
                batch_size=batch,
                drop_last=self.drop_last,
                nodes=world.nodes if ranks == world.world_size else None,
            )
            fitting = EpochSpec(place, spec, self.units)
            fitted = self.source.fit_window(fitting)
            pinned = self.__dict__.get("_pinned_window")
            if pinned is not None and pinned > fitted.window:
                raise ResumeStateError(
                    f"{self.source.url}: the state was saved reading with shuffle_window "
                    f"{pinned}, but this cache budget ({fitted.budget} bytes) holds "
                    f"shuffle_window {fitted.window} for {fitting.readers} readers at most; "
                    "resume with a budget that holds the state's window"
                )
            window = pinned if pinned is not None else fitted.window
            if window < spec.window:
                log.info("%s: %s", self.source.url, fitted.why(fitting.readers))
            windows[key] = window
        return spec if window == spec.window else dataclasses.replace(spec, window=window)

    def _state_extra(self, pr: Progress, fresh: bool) -> dict[str, Any]:
        """A shuffled epoch's state names the window it is read with (``window``)."""
        if not self.order_spec.shuffle or self.order_spec.window <= 1 or not self.source.remote:
            return {}
        return {"window": self._fitted_order(pr).window}

    def _load_extra(self, state: dict[str, Any], pr: Progress) -> None:
        """Read the resumed epoch with the state's window (without one: the requested)."""
        self.__dict__.pop("_windows", None)
        self.__dict__.pop("_pinned_window", None)
        if not self.order_spec.shuffle or "window" not in state:
            return
        window = state["window"]
        if type(window) is not int or not 1 <= window <= self.order_spec.window:
            raise ResumeStateError(
                f"{self.source.url}: the state's window must be an integer from 1 to "
                f"shuffle_window {self.order_spec.window}, got {window!r}"
            )
        self.__dict__["_pinned_window"] = window

    def _published(self) -> Any:
        return {"window": self.__dict__.get("_pinned_window")}

    def _synced(self, extra: Any) -> None:
        pinned = extra.get("window") if isinstance(extra, dict) else None
        if pinned != self.__dict__.get("_pinned_window"):
            self.__dict__.pop("_windows", None)
            self.__dict__["_pinned_window"] = pinned

    # -- reading -------------------------------------------------------------------
    def batchable(self) -> str | None:
        """Why this dataset's workers can't yield whole batches (None: they can)."""
        if self.transform is not None:
            return "a per-item transform is set"
        return None

    def _read_units(self, keys: np.ndarray) -> tuple[np.ndarray, Iterator[Any]]:
        chunks, items = self.unit_reader.read_units(keys)
        if self.transform is None:
            return chunks, items
        transform = self.transform
        return chunks, (transform(item) for item in items)

    def _chunks_of(self, keys: np.ndarray) -> np.ndarray:
        return self.unit_reader.chunks_of(keys)

    def _located_ahead(self, ahead: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
        """The chunks and positions of units ``ahead`` (items), located once per block."""
        if ahead is None or self.unit_reader.blocks is not None:
            return None
        memo = self._ahead_memo
        if memo is None or memo[0] is not ahead:
            memo = self._ahead_memo = (ahead, *self.index.locate_many(ahead))
        return memo[1], memo[2]

    def _batch(
        self, keys: np.ndarray, pool: batches.Pool, row: int, ahead: np.ndarray | None = None
    ) -> Any:
        """The batch of units ``keys``: assembled into one buffer when their leaves fit,
        else the items read one by one and collated by ``default_collate``. The headers
        read with a chunk's are those of the items of ``ahead`` in it."""
        row = pool.row  # counted on the row this process holds, not the one it preferred
        n = len(keys)
        ur = self.unit_reader
        if ur.blocks is not None:
            tb = ur.blocks
            tform = Form(("leaf", 0), (Leaf("a", tb.dtype.str, (tb.block_size,)),))
            if not batches.supported(tform):
                return self._collated(keys, row)
            buf, slot = self._buffer(tform, n, pool)
            tb.assemble_into(
                self.reader,
                keys,
                buf.numpy()[: tb.dtype.itemsize * tb.block_size * n]
                .view(tb.dtype)
                .reshape(n, tb.block_size),
            )
            return self._send(tform, n, buf, slot, pool, row)
        columns = getattr(ur, "columns_batch", None)  # a source with columns (Parquet)
        got = columns(keys) if columns is not None else None
        if got is not None:
            batches.count(self.batch_marks, row, "assembled")
            return default_convert(got)
        chunks, positions, by_range = ur.located(keys)
        if by_range:
            return self._collated(keys, row, chunks, positions)  # items read by range
        parts = []
        form: Form | None = None
        taken: tuple[int, Any] | None = None  # (slot, buffer): rows copied chunk by chunk
        near = self._located_ahead(ahead)
        for c in dict.fromkeys(chunks.tolist()):
            sel = np.nonzero(chunks == c)[0]
            cf = ur.chunk_forms(c)  # (waits for the chunk)
            pos = positions[sel]
            f = cf.form_of(pos, None if near is None else near[1][near[0] == c])
            if f is None or (form is not None and f != form):
                return self._collated(keys, row, chunks, positions)
            if form is None:
                form = f
                if not batches.supported(form, objects=True):
                    return self._collated(keys, row, chunks, positions)
                if not any(leaf.kind in OBJECT_KINDS for leaf in form.leaves):
                    # Fixed-width leaves only: each chunk's rows are copied as soon as it
                    # is here, while the batch's later chunks still download.
                    taken = pool.take(form.regions(max(n, self.batch_size))[1])
            if taken is not None:
                assemble_into(taken[1].numpy(), form, [(cf, pos, sel)], n)
            else:
                parts.append((cf, pos, sel))
        assert form is not None
        if taken is not None:
            return self._send(form, n, taken[1], taken[0], pool, row)
        # Bytes values travel in the buffer to another process (no pickling through the pipe).
        extra = 0 if pool.here else bytes_needed(form, parts)
        slot, buf = pool.take(form.regions(max(n, self.batch_size))[1] + extra)
        objects = assemble_into(buf.numpy(), form, parts, n)
        return self._send(form, n, buf, slot, pool, row, objects)

    def _collated(
        self,
        keys: np.ndarray,
        row: int,
        chunks: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> Any:
        """The per-item path: what a DataLoader worker collating these items returns."""
        batches.count(self.batch_marks, row, "collated")
        ur = self.unit_reader
        if ur.blocks is not None:
            items = list(ur.blocks.read_many(self.reader, keys))
        else:
            assert chunks is not None and positions is not None
            pairs = zip(chunks.tolist(), positions.tolist(), strict=True)
            items = [self.reader.read(ci, pos) for ci, pos in pairs]
        return default_collate(items)

    def _forget_forms(self) -> None:
        self.unit_reader.forget_forms()

    def _close_reading(self) -> None:
        self.reader.close()

    def _skip_range_reads(self) -> None:
        self.unit_reader.skip_range_reads()

    def _source_stats(self) -> list[float] | None:
        if not self.source.remote:
            return None
        st = self.source.stats
        return [float(getattr(st, f)) for f in STAT_FIELDS]

    def _settle(self) -> None:
        """At the end of a DataLoader worker's iteration: wait (bounded by ``timeout_s``)
        for the publishes of chunks it read before their publish ended. Its exit would
        wait for them too, but torch ends a worker that has not exited 5 s after the
        epoch (with exit status 0), and a chunk whose publish ran past that was lost to
        the cache (docs/streaming.md, "Statistics"). Past the bound, a warning says so."""
        if get_worker_info() is None or not self.source.remote:
            return
        if not self.source.wait_published():
            log.warning(
                "%s: chunk publishes still running %gs after this DataLoader worker's "
                "iteration ended (ASYNCCACHE_TIMEOUT_S); if the worker is ended before they "
                "finish, those chunks are not cached and will be downloaded again",
                self.source.url,
                self.settings.timeout_s,
            )

    def cache_usage(self) -> tuple[int, int]:
        """Bytes the local cache directory holds now (all datasets in it; 0 for a local
        dataset), and its budget (the store's: the setting, or less where the file system
        holds less)."""
        if not self.source.remote:
            return 0, self.settings.max_cache_bytes
        return scan(self.source.cache_dir)[0], self.source.downloader().store.budget()

    # -- planning the node's reads -----------------------------------------------------
    def epoch_spec(
        self, place: ReaderPlace, epoch_size: int | None = None, view: View | None = None
    ) -> EpochSpec:
        """How the node reads this dataset for a reader at ``place`` (``epoch_size``: the
        samples a mix takes of it, and ``view``: its part of the mix; None: its own)."""
        # A mix reads its streams in their requested windows (its own order, see .mixed).
        order = self._fitted_order() if view is None and epoch_size is None else self.order_spec
        if epoch_size is not None:
            order = dataclasses.replace(order, epoch_size=epoch_size)
        return EpochSpec(place, order, self.units, view)

    def _plan_epoch(self, pr: Progress, world: distributed.World, logical: int) -> None:
        place = reader_place(pr, self.epoch_total, world, logical, self.drop_last)
        self.source.plan_epoch(self.epoch_spec(place), skipped=self._skip + self._ahead)

    def _plan_node(self) -> None:
        world = self._world()
        pr, _ = self._plan(world)
        place = reader_place(pr, self.epoch_total, world, 0, self.drop_last)
        self.source.plan_node(self.epoch_spec(place))

    def _hint(
        self, order: ReadOrder, segments: list[Segment], seg: Segment, a: int, chunks: Any
    ) -> None:
        """Tell the downloader which chunks this worker needs next, in order (unless the
        source follows the epoch plan, which knows that already)."""
        if not self.source.remote or self.source.planned:
            return
        depth = self.source.downloader().window_depth(self.source.mean_chunk_bytes)
        want = depth + self.shuffle_window
        seen: dict[int, None] = dict.fromkeys(chunks.tolist())
        end = min(seg.end, a + BLOCK)
        later = [(end, seg.end)] + [(s.start, s.end) for s in segments[segments.index(seg) + 1 :]]
        for lo, hi in later:
            pos = lo
            while pos < hi and len(seen) < want:
                nxt = order.keys(pos, min(hi, pos + _LOOKAHEAD))
                seen.update(dict.fromkeys(order.chunks_of(nxt).tolist()))
                pos += _LOOKAHEAD
            if len(seen) >= want:
                break
        self.source.hint(list(seen)[:want])

    # -- the first batches, built in the main process (:mod:`.lead`) -------------------
    def _lead_alone(self, keys: np.ndarray) -> bool:
        return self.shuffle and self.unit_reader.reads_by_range(keys)

    def _lead_fetches_nothing(self, runs: list[np.ndarray]) -> bool:
        """The units of ``runs`` can be read here without downloading a whole chunk
        (range reads up to ``first_read_bytes`` per run)."""
        keys = np.concatenate(runs)
        if self.unit_reader.blocks is not None:  # token chunks are not read by range
            return self.unit_reader.all_landed(keys)
        self.reader.set_range_budget(self.source.first_read_bytes * len(runs))
        # The dataset's chunks under 1 MiB (its writers' remainders) come whole here (a
        # shuffled first batch that drew one of their items would otherwise come from a
        # worker, later). Only when the whole dataset fits the budget: this process follows
        # no plan, and its reservation would evict by recency (as for the head start).
        small = self.source.remote and self.source.fits_cache()
        located = self.index.locate_many(keys)
        if self.reader.fetches_no_chunk(*located, small=small, whole=True):
            return True
        self.reader.set_range_budget(self.source.first_read_bytes)
        return False

    def _lead_expect(self, runs: list[np.ndarray]) -> None:
        """Read every run's items not cached by range, in one round."""
        if self.unit_reader.blocks is None and len(runs) > 1:
            self.reader.expect(*self.index.locate_many(np.concatenate(runs)), whole=True)

    def _release_lead(self, chunks: list[int]) -> None:
        for ci in chunks:
            self.reader.release(ci)

    def _lead_long_copy(self, runs: list[np.ndarray]) -> bool:
        keys = np.concatenate(runs)
        if self.unit_reader.blocks is not None:
            return False  # (token blocks: their lead is a few small blocks)
        idx = self.index
        chunks = idx.locate_many(keys)[0]
        mean = idx.bytes_per_chunk[chunks] / np.maximum(idx.items_per_chunk[chunks], 1)
        if float(mean.sum()) < _FORK_FIRST_BYTES:
            return False  # built sooner than the forks take
        return self.unit_reader.all_landed(keys)

    def _far_link(self) -> bool:
        """This process has measured a first byte of this dataset's storage at
        ``_FAR_TTFB_S`` or longer (its least wait; False before any, and for a local
        dataset). Safe from any thread; opens nothing; never raises (asked from the thread
        that starts the workers)."""
        try:
            link = self.source.link
            ttfb = link.ttfb_s if link is not None else None
        except Exception:
            return False
        return ttfb is not None and ttfb >= _FAR_TTFB_S

    def _head_start(self, p: Plan, order: Any, received: int) -> None:
        if not self.source.remote or len(p.workers) < 2 or not self.settings.head_start:
            return
        if not self.source.fits_cache():
            return
        self._heads.start(workers_first_chunks(p, order, received, self._chunks_of))

    def _head_go(self) -> None:
        self._heads.go()

    def _head_stop(self) -> None:
        self._heads.stop()

    # -- resume --------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return self.source.url

    def identity(self) -> dict[str, Any]:
        """What a resume state must match: the dataset and everything that makes its
        order (a state from another order can't be continued)."""
        out = {
            "dataset": self.index.checksum,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "subsample": self.subsample,
            "epoch_size": self.epoch_size,
            "drop_last": self.drop_last,
        }
        if self.item_loader is not None:  # blocks of another size are other samples
            out["item_loader"] = self.item_loader.name
        return out

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Drop this process's mappings, pins, downloads and HTTP session. Idempotent.

        Garbage collection does the same; a closed dataset reconnects if used again.
        """
        self.unit_reader.close()
        self.source.close()

    def __repr__(self) -> str:
        return (
            f"StreamingDataset({self.source.url!r}, items={self.num_items}, "
            f"shuffle={self.shuffle}, epoch={self.epoch})"
        )


def _order_spec(
    seed: int, shuffle: bool, window: int, subsample: float | None, epoch_size: int | None
) -> OrderSpec:
    try:
        return OrderSpec(seed, shuffle, window, subsample, epoch_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
