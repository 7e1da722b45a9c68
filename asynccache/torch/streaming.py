"""``StreamingDataset``: stream a written dataset from any URL, in a reproducible order."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from ..bridge import lifeline
from ..config import Settings
from ..download.link import endpoint_of, link_for
from ..errors import ConfigError, ResumeStateError
from ..read.batchread import ChunkForms, Form, Leaf, assemble_into
from ..read.reader import Reader
from ..read.source import DatasetSource
from ..read.token_blocks import TokenBlocks, TokenUnits
from ..sampling import Plan, Segment, consumed_to_remaining, plan
from ..sampling.order import ItemUnits, OrderSpec, ReadOrder, Units
from ..sampling.partition import Interval, received_per_worker
from . import batches, distributed

log = logging.getLogger(__name__)
STATE_VERSION = 1
_BLOCK = 512  # positions materialised at a time; bounds memory per worker
_LOOKAHEAD = 8192  # positions scanned at a time when looking for the next chunks
_SLOTS = 1024  # epoch counters, one per DataLoader worker slot (see _take_epoch)
_PLAN_BYTES = 56 << 10  # room for the published plan (a few intervals in JSON)
# Download statistics, one row per process that iterates (worker w: row w mod 256; the
# main process: the last row), each cumulative over the processes that used it.
_STAT_ROWS = 257
_STAT_FIELDS = ("bytes", "chunks_fetched", "hits", "misses", "retries", "wait_s")
_STATS_AT = _SLOTS * 8 + 8 + _PLAN_BYTES
# The most batches CacheDataLoader builds in the main process at an epoch's start (one
# per worker, each worker's first): the second batch is ready while the workers start;
# more would delay the first (their items come in one round of range reads). One when
# the first batch's items are read by range from a shuffled order: a second batch's 64
# more item GETs made the first 2-3x later (0.42-0.62 s against 0.18-0.39 at load 2-4).
_LEAD_BATCHES = 2
# The main process starts the workers' first chunks only on a link where downloading them
# takes at least this long (see StreamingDataset._head_go): on loopback (about 0.25 s for
# two 64 MiB chunks) a worker's wait for the main process's fsync cost more than it saved.
_HEAD_MIN_S = 1.0
_HEAD_MIN_TTFB_S = 0.01  # ... or, with no rate measured yet, where a first byte takes this
# A link is far when its first byte takes at least this long, as this process measured it
# (the index's column sidecar, the first batches' range reads): there the first batches
# built in the main process wait on the network, not on the CPU, and the DataLoader's
# workers are started beside them at once (see dataloader._led).
_FAR_TTFB_S = 0.02


@dataclasses.dataclass(frozen=True)
class _Progress:
    """Where an epoch stands: the plan it runs and how much of it was already received.

    ``remaining`` (None: the whole epoch) is split for ``(world, num_workers,
    batch_size)``; each rank's consumer has received the first ``received`` samples of
    its share. Continuing with the same configuration keeps the exact order; with another
    one, what is left is split anew (see :func:`consumed_to_remaining`).
    """

    epoch: int = 0
    remaining: tuple[Interval, ...] | None = None
    world: int = 1
    num_workers: int = 1
    batch_size: int = 1
    received: int = 0

    def base(self, total: int) -> list[Interval]:
        if self.remaining is not None:
            return list(self.remaining)
        return [(0, total)] if total else []

    def adapted(
        self, world: int, num_workers: int, batch_size: int, total: int, drop_last: bool
    ) -> _Progress:
        """The same position, expressed for this configuration."""
        if self.received == 0:
            return dataclasses.replace(
                self, world=world, num_workers=num_workers, batch_size=batch_size
            )
        if (world, num_workers, batch_size) == (self.world, self.num_workers, self.batch_size):
            return self
        rest = consumed_to_remaining(
            self.base(total),
            world=self.world,
            num_workers=self.num_workers,
            batch_size=self.batch_size,
            drop_last=drop_last,
            received=self.received,
        )
        return _Progress(self.epoch, tuple(rest), world, num_workers, batch_size, 0)


def _shared_bytes(n: int) -> torch.Tensor:
    """``n`` zero bytes of shared memory, read and written through numpy views only.

    Created directly as shared memory (zero-filled by the kernel) rather than with
    ``torch.zeros(...).share_memory_()``: filling or copying that many bytes runs on
    torch's intra-op (OpenMP) pool, which hangs in a process forked from one that used it.
    """
    storage = torch.UntypedStorage._new_shared(n)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _drop(segments: tuple[Segment, ...], n: int) -> list[Segment]:
    """``segments`` without their first ``n`` positions."""
    out = []
    for seg in segments:
        if n >= len(seg):
            n -= len(seg)
            continue
        out.append(Segment(seg.start + n, seg.end, seg.pad))
        n = 0
    return out


class StreamingDataset(IterableDataset[Any]):
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
    samples, like ``DistributedSampler``.

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
    """

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
    ) -> None:
        self.order_spec = _order_spec(seed, shuffle, shuffle_window, subsample, epoch_size)
        self.settings = settings or Settings.from_env(max_cache_bytes=max_cache_bytes)
        self.source = DatasetSource(
            input_dir, cache_dir=cache_dir, storage_options=storage_options, settings=self.settings
        )
        self.index = self.source.index
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.transform = transform
        self._batch_size = batch_size
        self.shuffle_window = shuffle_window
        self.subsample, self.epoch_size = subsample, epoch_size
        self.units: Units = ItemUnits(self.index)
        self.item_loader = item_loader
        self._blocks: TokenUnits | None = None
        if item_loader is not None:
            if not isinstance(item_loader, TokenBlocks):
                raise ConfigError(f"item_loader must be a TokenBlocks, got {item_loader!r}")
            self.units = self._blocks = item_loader.bind(self.index, self.source.url)
        self._check_order()
        self._num_workers: int | None = None  # set by CacheDataLoader; else from torch
        self._progress = _Progress()
        # Chunks a reader keeps mapped: in order it reads one chunk, and a batch or a
        # token block may straddle the next; shuffled, a window is read at once, and a
        # batch may straddle the next window. More would only keep mapped pages resident
        # (a worker's memory) and chunks pinned.
        self._open_chunks = shuffle_window + 2 if shuffle else 2
        self._reader = Reader(
            self.index,
            self.source.acquire,
            release=self.source.release,
            ranged=self.source,
            verify=not self.source.remote,
            allow_pickle=allow_pickle,
            max_open=self._open_chunks,
        )
        self._yielded = 0
        self._rank_world = distributed.rank_and_world()
        # None: each worker yields items (the DataLoader collates them); else each worker
        # yields whole batches of batch_size (the value: drop a short last batch).
        self._batch_mode: bool | None = None
        # Samples of this epoch the main process handed out itself before its DataLoader
        # workers started (CacheDataLoader's first batch): the workers begin after them.
        self._head = 0
        self._led = 0  # epochs whose first batches this process built (see _lead)
        self._new_busy()
        # Shared with every DataLoader worker (forked or spawned, persistent or not): the
        # epoch counters and the plan the main process published (see _publish).
        self._shared = _shared_bytes(_STATS_AT + _STAT_ROWS * len(_STAT_FIELDS) * 8)
        self._owner = os.getpid()  # the process whose workers share this block
        self._expect = 0  # the counter value this process last wrote or advanced to
        self._pending: tuple[_Progress, int] | None = None  # a worker's loaded state
        self._skip = 0  # items this worker had yielded of its run before a resume
        self._stats_pid = -1  # the process whose statistics row base was taken
        self._stats_base = np.zeros(len(_STAT_FIELDS))
        self._publish()

    def _world(self, num_workers: int | None = None) -> distributed.World:
        if get_worker_info() is None:  # the main process sees the process group
            self._rank_world = distributed.rank_and_world()
        return distributed.current(num_workers or self.num_workers, captured=self._rank_world)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = value
        if "_shared" in self.__dict__:
            self._publish()

    @property
    def num_workers(self) -> int | None:
        """The consumer's DataLoader worker count (None: as torch reports it)."""
        return self._num_workers

    @num_workers.setter
    def num_workers(self, value: int | None) -> None:
        self._num_workers = value
        if "_shared" in self.__dict__:
            self._publish()

    # -- size and random access ----------------------------------------------------
    @property
    def num_items(self) -> int:
        """Items (with ``item_loader=TokenBlocks``: blocks) the dataset holds."""
        if self._blocks is not None:
            return len(self._blocks)
        return self.index.total_items

    @property
    def epoch_total(self) -> int:
        """Positions of one epoch over all ranks (``epoch_size``, else the units read)."""
        return self._order().total

    def _check_order(self) -> None:
        try:
            ReadOrder(self.units, self.order_spec, 0)
        except ValueError as exc:
            raise ConfigError(f"{self.source.url}: {exc}") from exc

    def __len__(self) -> int:
        """Samples this rank yields in the (rest of the) current epoch."""
        pr, p = self._plan(self._world())
        return p.rank_samples - pr.received

    def __getitem__(self, key: int) -> Any:
        if self._blocks is not None:
            if not 0 <= int(key) < len(self._blocks):
                raise IndexError(f"block {key} is out of range for {len(self._blocks)} blocks")
            item = self._blocks.read(self._reader, int(key))
        else:
            item = self._reader[int(key)]
        return self.transform(item) if self.transform else item

    # -- epochs --------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` from its beginning (drops a partially
        resumed one). Without it, each ``iter()`` runs the epoch after the previous one."""
        self._progress = _Progress(epoch=epoch)
        self._head = 0
        self._world()  # capture rank and world size for the DataLoader workers
        self._set_counters(epoch)
        self._publish()

    # -- the plan shared with DataLoader workers -----------------------------------
    def _own(self) -> None:
        """Give a process that is not a DataLoader worker its own shared block.

        A copy of the dataset in another process (a forked child, a rank started with
        ``mp.spawn``, Lightning's ``ddp_spawn``) would otherwise share the creating
        process's counters, and the ranks would advance each other's epochs. Its
        DataLoader workers then share the new block. Download statistics start at zero.
        """
        pid = os.getpid()
        if self._owner == pid or get_worker_info() is not None:
            return
        fresh = _shared_bytes(self._shared.numel())
        fresh.numpy()[:_STATS_AT] = self._shared.numpy()[:_STATS_AT]
        self._shared, self._owner = fresh, pid
        self._new_busy()
        self._stats_pid, self._stats_base = -1, np.zeros(len(_STAT_FIELDS))

    def _counters(self) -> np.ndarray:
        self._own()
        return self._shared[: _SLOTS * 8].numpy().view(np.int64)

    def _set_counters(self, epoch: int) -> None:
        self._counters()[:] = epoch
        self._expect = epoch

    def _publish(self) -> None:
        """Write what a worker needs to run an epoch where every worker reads it: workers
        of a ``persistent_workers=True`` DataLoader keep the copy of the dataset they
        started with, so attributes set later in the main process would not reach them."""
        if get_worker_info() is not None:
            return
        self._own()
        pr = self._progress
        plan = {
            "progress": [
                pr.epoch,
                None if pr.remaining is None else [list(r) for r in pr.remaining],
                pr.world,
                pr.num_workers,
                pr.batch_size,
                pr.received,
            ],
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "rank_world": list(self._rank_world),
            "batched": getattr(self, "_batch_mode", None),
            "head": self.__dict__.get("_head", 0),
        }
        raw = json.dumps(plan).encode()
        if len(raw) > _PLAN_BYTES:
            raise ResumeStateError(
                f"{self.source.url}: the epoch's position holds too many intervals "
                f"({len(raw)} bytes) to share with DataLoader workers"
            )
        head = _SLOTS * 8
        self._shared[head : head + 8].numpy().view(np.int64)[0] = len(raw)
        self._shared[head + 8 : head + 8 + len(raw)].numpy()[:] = np.frombuffer(raw, np.uint8)

    def _sync(self) -> None:
        """In a worker: take the plan the main process published."""
        head = _SLOTS * 8
        n = int(self._shared[head : head + 8].numpy().view(np.int64)[0])
        plan = json.loads(bytes(self._shared[head + 8 : head + 8 + n].numpy()))
        e, remaining, world, nw, bs, received = plan["progress"]
        self._progress = _Progress(
            e,
            None if remaining is None else tuple((int(a), int(b)) for a, b in remaining),
            world,
            nw,
            bs,
            received,
        )
        self.batch_size, self.num_workers = plan["batch_size"], plan["num_workers"]
        self._rank_world = (int(plan["rank_world"][0]), int(plan["rank_world"][1]))
        self._batch_mode = plan.get("batched")
        self._head = int(plan.get("head", 0))

    def _stat_table(self) -> np.ndarray:
        self._own()
        return self._shared[_STATS_AT:].numpy().view(np.float64).reshape(_STAT_ROWS, -1)

    def _report_stats(self) -> None:
        """Add this process's download counters to its row of the shared table."""
        if not self.source.remote:
            return
        info = get_worker_info()
        row = _STAT_ROWS - 1 if info is None else info.id % (_STAT_ROWS - 1)
        table = self._stat_table()
        pid = os.getpid()
        if self._stats_pid != pid:  # a new process: the row holds its predecessors'
            self._stats_base = table[row].copy()
            self._stats_pid = pid
        st = self.source.stats
        table[row] = self._stats_base + np.array([float(getattr(st, f)) for f in _STAT_FIELDS])

    def _settle(self) -> None:
        """At the end of a DataLoader worker's iteration: wait (bounded by ``timeout_s``)
        for the publishes of chunks it read before their publish ended. Its exit would
        wait for them too, but torch ends a worker that has not exited 5 s after the
        epoch (with exit status 0), and a chunk whose fsync ran past that was lost to the
        cache (docs/streaming.md, "Statistics"). Past the bound, a warning says so."""
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

    def download_stats(self) -> dict[str, float]:
        """Download counters summed over this process and every DataLoader worker that
        iterated this dataset (workers report as they go: at least every few hundred
        items and when their iterator ends)."""
        self._report_stats()
        total = self._stat_table().sum(axis=0)
        return {f: float(v) for f, v in zip(_STAT_FIELDS, total, strict=True)}

    def _take_epoch(self, pinned: int | None = None) -> int:
        """The epoch this ``iter()`` runs, and advance the counters past it.

        Worker ``w`` of ``W`` reads counter slot ``w`` and sets slots ``w, w+W, ...`` to the
        next epoch, so every slot advances once per epoch whatever the worker count and
        no two workers of a loader touch the same slot: all workers of an epoch (and a
        later loader with another worker count) agree. Iterated in this process, it is
        worker 0 of 1. ``pinned``: the epoch a loaded worker state runs.
        """
        info = get_worker_info()
        w, nw = (0, 1) if info is None else (info.id, info.num_workers)
        if nw > _SLOTS:
            raise ConfigError(f"StreamingDataset supports at most {_SLOTS} DataLoader workers")
        counters = self._counters()
        epoch = int(counters[w]) if pinned is None else pinned
        counters[w::nw] = epoch + 1
        self._expect = epoch + 1
        return epoch

    @property
    def epoch(self) -> int:
        return self._progress.epoch

    def _plan(self, world: distributed.World) -> tuple[_Progress, Plan]:
        workers = max(1, self.num_workers or world.num_workers)
        pr = self._progress.adapted(
            world.world_size, workers, self.batch_size, self.epoch_total, self.drop_last
        )
        p = plan(
            pr.base(self.epoch_total),
            world=world.world_size,
            rank=world.rank,
            num_workers=workers,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )
        return pr, p

    def _order(self) -> ReadOrder:
        """This epoch's order as read (the same the node's read plan is built from)."""
        order = self.__dict__.get("_order_cache")
        if order is None or order.epoch != self._progress.epoch:
            order = ReadOrder(self.units, self.order_spec, self._progress.epoch)
            self.__dict__["_order_cache"] = order
        return order

    def __iter__(self) -> Iterator[Any]:
        in_worker = get_worker_info() is not None
        if in_worker:
            # A forkserver worker's parent is the fork server, which torch's watchdog
            # watches instead of this loader's process: end with the real one.
            lifeline.exit_with_parent()
            self._sync()
        pending, self._pending = self._pending, None
        if pending is not None:  # a worker's own state, loaded by a stateful DataLoader
            self._progress, self._skip = pending
            self._take_epoch(self._progress.epoch)
        else:
            # A worker starting after a batch the main process built runs the epoch that
            # batch came from (another loader's workers over this dataset may have moved
            # the counters on meanwhile).
            epoch = self._take_epoch(self._progress.epoch if in_worker and self._head else None)
            self._skip = 0
            if self._progress.epoch != epoch:
                self._progress = _Progress(epoch=epoch)
                self._head = 0  # handed out of another epoch
            if not in_worker:
                self._publish()
        world = self._world()
        pr, p = self._plan(world)
        # Continuing a plan: batch p of the rank comes from logical worker p mod W, and a
        # DataLoader starts its round robin at worker 0, so worker j plays logical worker
        # (batches received + j) mod W, skipping what the consumer already has of it.
        # `head`: samples the main process handed out itself before these workers started
        # (CacheDataLoader's first batch): received too, but the epoch's plan is the
        # plain one, whose reader skips them as its own (`_ahead`).
        nw = pr.num_workers
        head = self._head if in_worker and pending is None else 0
        logical = ((pr.received + head) // pr.batch_size + world.worker) % nw
        skip = received_per_worker(p.rank_samples, nw, pr.batch_size, pr.received)[logical]
        self._ahead = (
            received_per_worker(p.rank_samples, nw, pr.batch_size, pr.received + head)[logical]
            - skip
        )
        segments = _drop(p.workers[logical], skip + self._ahead + self._skip)
        order = self._order()
        self._plan_epoch(pr, world, logical)
        if self._ahead and nw > 1:
            # The main process built this worker's first batch: its next one is a round of
            # the other workers' batches away. Its chunks start downloading now, not after
            # range reads of that batch (docs/streaming.md: with one batch built, shuffled,
            # reading it by range as well made a cold epoch slower: 2.1 s against 1.6 s).
            self._skip_range_reads()
        self._yielded = 0
        batch_mode = getattr(self, "_batch_mode", None)  # (a MixedDataset has none)
        if batch_mode is not None:
            yield from self._iter_batches(order, segments, batch_mode)
            return
        try:
            for seg in segments:
                for a in range(seg.start, seg.end, _BLOCK):
                    self._report_stats()
                    keys = order.keys(a, min(seg.end, a + _BLOCK))
                    chunks, items = self._read_units(keys)
                    for j, item in enumerate(items):
                        if j == 0:  # after the first read: it had the bandwidth to itself
                            self._hint(order, segments, seg, a, chunks)
                        self._yielded += 1
                        yield self.transform(item) if self.transform else item
        finally:
            self._settle()
            self._report_stats()
            self._reader.close()

    # -- whole batches (docs/streaming.md, "Batches") ---------------------------------
    def _new_busy(self) -> None:
        """A fresh block of busy marks for pooled batch buffers (see torch/batches.py)."""
        self._busy = batches.shared_bytes(batches.BLOCK_BYTES)
        self._busy_token = secrets.token_hex(8)
        batches.register(self._busy_token, self._busy)

    def batchable(self) -> str | None:
        """Why this dataset's workers can't yield whole batches (None: they can)."""
        if self.transform is not None:
            return "a per-item transform is set"
        return None

    def batch_stats(self) -> dict[str, int]:
        """Batches this dataset's workers assembled from the chunks (``assembled``) or
        collated from decoded items (``collated``: leaves that don't fit), and the pooled
        / one-off buffers they allocated, summed over every worker."""
        self._own()
        return batches.counters(self._busy)

    def _set_batch_mode(self, drop_last: bool | None) -> None:
        """Make workers yield whole batches of ``batch_size`` (``drop_last``: drop a short
        last batch), or items again (None)."""
        self._batch_mode = drop_last
        self._publish()

    def _iter_batches(self, order: ReadOrder, segments: list[Segment], drop_last: bool) -> Any:
        """This worker's run in batches of ``batch_size``: the same batches, in the same
        order, that a DataLoader collating its items with ``default_collate`` makes."""
        bs = self.batch_size
        info = get_worker_info()
        # A worker's row of busy marks (the main process, iterating itself: the last row).
        row = batches.MAIN_ROW if info is None else info.id % batches.MAIN_ROW
        pool = self._batch_pool(row, here=info is None)
        self.__dict__["_forms"] = collections.OrderedDict()
        pending: list[np.ndarray] = []
        held = 0
        try:
            for seg in segments:
                for a in range(seg.start, seg.end, _BLOCK):
                    self._report_stats()
                    keys = order.keys(a, min(seg.end, a + _BLOCK))
                    pending.append(keys)
                    held += len(keys)
                    hinted = False
                    while held >= bs:
                        run = np.concatenate(pending)
                        pending, held = [run[bs:]], len(run) - bs
                        out = self._batch(run[:bs], pool, row)
                        if not hinted:
                            self._hint(order, segments, seg, a, self._chunks_of(keys))
                            hinted = True
                        self._yielded += bs
                        yield out
                        out = None  # (the consumer's now: a frame holding it would keep it busy)
                    if not hinted:
                        self._hint(order, segments, seg, a, self._chunks_of(keys))
            if held and not drop_last:
                run = np.concatenate(pending)
                out = self._batch(run, pool, row)
                self._yielded += len(run)
                yield out
        finally:
            self.__dict__.pop("_forms", None)
            self._settle()
            self._report_stats()
            self._reader.close()

    def _batch_pool(self, row: int, here: bool) -> batches.Pool:
        """This process's pool of batch buffers (busy-mark row ``row``; ``here``: the
        consumer is this process)."""
        pool = self.__dict__.get("_pool")
        if (
            pool is None
            or pool.block is not self._busy
            or self.__dict__.get("_pool_pid") != os.getpid()
        ):
            pool = self.__dict__["_pool"] = batches.Pool(self._busy, self._busy_token, row, here)
            self.__dict__["_pool_pid"] = os.getpid()
        return pool

    # -- the first batch, built in the main process (docs/streaming.md) ---------------
    def _lead(self) -> list[np.ndarray] | None:
        """In the main process, before the DataLoader workers start: the units of the
        batches this rank receives next (up to ``_LEAD_BATCHES``, each a different
        logical worker's next batch, in the order the consumer receives them), which the
        workers will then leave out (they start where a loader resumed after those
        batches starts). None, and the workers start as usual, unless whole batches come
        from the workers and more than one batch of this rank's epoch is left. At least
        one batch is left to the workers; fewer are built here when a worker's batch is
        short, when only fewer can be read without downloading a whole chunk here, and
        one alone when its items are read by range from a shuffled order."""
        self._head = 0
        world = self._world()
        pr, p = self._plan(world)
        bs, nw = pr.batch_size, pr.num_workers
        left = p.rank_samples - pr.received
        if self._batch_mode is None or left <= bs:
            self._publish()
            return None
        order = self._order()
        runs: list[np.ndarray] = []
        # At least one batch is left to the workers.
        for i in range(min(nw, _LEAD_BATCHES, (left - 1) // bs)):
            # Batch k of the rank comes from logical worker k mod W (see __iter__).
            logical = (pr.received // bs + i) % nw
            skip = received_per_worker(p.rank_samples, nw, bs, pr.received + i * bs)[logical]
            keys: list[np.ndarray] = []
            need = bs
            for seg in _drop(p.workers[logical], skip):
                take = min(need, len(seg))
                keys.append(order.keys(seg.start, seg.start + take))
                need -= take
                if not need:
                    break
            if need:  # a short batch: that worker's last, made as usual
                break
            runs.append(np.concatenate(keys))
            if self.shuffle and self._lead_reads_by_range(runs[0]):
                break  # scattered items, one GET each: the first batch alone
        # Only batches this process can build without downloading whole chunks: read by
        # range (up to first_read_bytes for each worker it stands in for: one round of
        # range GETs for all), or from chunks in the cache (the workers' plans download,
        # evict and check the budget).
        while runs and not self._lead_fetches_nothing(runs):
            runs.pop()
        if not runs:
            self._publish()
            return None
        self._head = bs * len(runs)
        self._lead_no = self.__dict__.get("_lead_no", 0) + 1
        self._led += 1
        self._publish()
        self._lead_last = self.__dict__.get("_lead_batches", 0) + len(runs)
        self._head_start(p, order, pr.received + self._head)
        return runs

    def _workers_first_chunks(self, p: Plan, order: ReadOrder, received: int) -> list[int]:
        """The chunks of each logical worker's first batch after the consumer received
        ``received`` samples (what the workers compute in :meth:`__iter__`), each
        worker's first chunk first: worker after worker, then their second ones."""
        nw, bs = len(p.workers), p.batch_size
        after = received_per_worker(p.rank_samples, nw, bs, received)
        per_worker: list[list[int]] = []
        for i in range(nw):
            logical = (received // bs + i) % nw  # in the order the consumer receives them
            keys: list[np.ndarray] = []
            need = bs
            for seg in _drop(p.workers[logical], after[logical]):
                take = min(need, len(seg))
                keys.append(order.keys(seg.start, seg.start + take))
                need -= take
                if not need:
                    break
            if keys:
                first = self._chunks_of(np.concatenate(keys))
                per_worker.append(list(dict.fromkeys(first.tolist())))
        out: dict[int, None] = {}
        for k in range(max((len(c) for c in per_worker), default=0)):
            out.update(dict.fromkeys(c[k] for c in per_worker if k < len(c)))
        return list(out)

    def _head_go(self) -> None:
        """The lead batches are built (their range reads are in): the downloads
        :meth:`_head_start` readied may take this process's connections now. Not before:
        on loopback a download moves hundreds of MB/s on this process's I/O thread, and
        the batches being built would share the interpreter lock with it.

        Only on a link where they take at least ``_HEAD_MIN_S`` (as the link measured
        so far, the range reads included, says; with no rate yet, where a first byte
        takes at least ``_HEAD_MIN_TTFB_S``): a worker waits for the published name,
        the main process's fsync included, and where the download is quicker than that
        the worker does better fetching the chunk itself (it reads its own download
        before the fsync). Elsewhere they are cancelled here."""
        heads = self.__dict__.get("_heads")
        if heads is None or heads[0] != os.getpid():
            return
        dl, size, parts = heads[1:]
        link = link_for(endpoint_of(dl.storage))
        rate, ttfb = link.bytes_per_s, link.ttfb_s
        if rate is not None:
            slow = size / (rate * min(parts, self.settings.max_concurrency)) >= _HEAD_MIN_S
        else:  # (loopback hands a range read over in one piece: no rate, a first byte)
            slow = ttfb is None or ttfb >= _HEAD_MIN_TTFB_S
        if slow:
            dl.release_prefetch()
        else:
            self._head_stop()

    def _head_start(self, p: Plan, order: ReadOrder, received: int) -> None:
        """In the main process, before the DataLoader workers start: start downloading
        each worker's first chunks here (docs/cache.md, "The workers' first chunks").

        The workers fork, open their sessions and plan for 0.5-1 s; meanwhile this
        process's connections would idle once the first batches' range reads are in. A
        worker that asks for such a chunk finds its download lock held and waits for the
        published name, so each chunk is still fetched once. The downloads take their
        locks and reservations now, their parts no connection until the first batches
        are built (:meth:`_head_go`): their range reads share the connections.

        Only when the whole dataset fits in the cache budget: this process follows no
        plan, and its reservations would evict by recency, not by the order the workers
        read. The downloads end with the epoch (:meth:`_head_stop`), at :meth:`close`,
        or when a new epoch's start replaces them; a forked worker does not inherit
        them (its downloader is its own)."""
        if not self.source.remote or len(p.workers) < 2 or not self.settings.head_start:
            return
        if getattr(self, "streams", None) is not None:
            return  # a mix: each stream's source follows a plan of its own
        if not self._fits_cache():
            return
        dl = self.source.downloader()
        # Only what this process's connections carry at once (each a part of the start
        # size): a chunk started later here would find a worker downloading it already.
        room = self.settings.max_concurrency * self.settings.part_bytes
        chunks: list[int] = []
        for c in self._workers_first_chunks(p, order, received):
            if room <= 0 or len(chunks) >= max(self.settings.prefetch_chunks, 1):
                break
            chunks.append(c)
            room -= int(self.index.bytes_per_chunk[c])
        if chunks:
            dl.hold_prefetch(self.settings.timeout_s)
            dl.hint([self.source.spec(c) for c in chunks])
            sizes = [int(self.index.bytes_per_chunk[c]) for c in chunks]
            parts = sum(-(-n // self.settings.part_bytes) for n in sizes)
            self.__dict__["_heads"] = (os.getpid(), dl, sum(sizes), parts)

    def _head_stop(self) -> None:
        """The epoch is over: cancel what :meth:`_head_start` started and nobody took."""
        heads = self.__dict__.pop("_heads", None)
        if heads is not None and heads[0] == os.getpid():
            heads[1].hint([])  # (cancelled before their held parts could go out)
            heads[1].release_prefetch()

    def _lead_fetches_nothing(self, runs: list[np.ndarray]) -> bool:
        """The units of ``runs`` can be read here without downloading a whole chunk
        (range reads up to ``first_read_bytes`` per run)."""
        keys = np.concatenate(runs)
        if self._blocks is not None:  # token chunks are not read by range: all cached?
            return self._all_landed(keys)
        self._reader.set_range_budget(self.source.first_read_bytes * len(runs))
        # The dataset's small last chunk comes whole here: without it a shuffled first
        # batch that drew one of its items was not built here at all, and came from a
        # worker 0.3-0.4 s later (2 of 14 cold starts of 512 MiB). Only when the whole
        # dataset fits the budget: this process follows no plan, and its reservation
        # would evict by recency (as for the head start).
        tail = self.source.remote and self._fits_cache()
        if self._reader.fetches_no_chunk(*self.index.locate_many(keys), small_tail=tail):
            return True
        self._reader.set_range_budget(self.source.first_read_bytes)
        return False

    def _skip_range_reads(self) -> None:
        """In a worker whose first batch the main process built: read nothing by range
        this epoch, and send the epoch plan's prefetch hint now."""
        self._reader.set_range_budget(0)
        self.source.send_hint()

    def _lead_reads_by_range(self, keys: np.ndarray) -> bool:
        """Some of units ``keys`` are in chunks not in the cache (read by range here)."""
        return self.source.remote and not self._all_landed(keys)

    def _all_landed(self, keys: np.ndarray) -> bool:
        """Every chunk units ``keys`` read (a token block's last chunk too) is cached."""
        if self._blocks is not None:
            first, last = self._blocks.chunks_of(keys), self._blocks.last_chunks(keys)
            pairs = zip(first.tolist(), last.tolist(), strict=True)
            chunks = {c for a, b in pairs for c in range(a, b + 1)}
        else:
            chunks = set(self.index.locate_many(keys)[0].tolist())
        return all(self.source.landed(c) for c in chunks)

    def _fits_cache(self) -> bool:
        """The whole dataset fits this node's cache budget (the store's: the setting, or
        less where the file system holds less). Remote datasets only."""
        store = self.source.downloader().store
        return int(self.index.bytes_per_chunk.sum()) <= store.max_cache_bytes

    def _far_link(self) -> bool:
        """This process has measured a first byte of this dataset's storage at
        ``_FAR_TTFB_S`` or longer (its least wait; False before any, and for a local
        dataset). Safe from any thread; opens nothing."""
        try:
            link = self.source.link
            ttfb = link.ttfb_s if link is not None else None
        except Exception:  # (asked from the thread that starts the workers: never raise)
            return False
        return ttfb is not None and ttfb >= _FAR_TTFB_S

    def _lead_expect(self, runs: list[np.ndarray]) -> None:
        """Before the first of ``runs`` is built: read every run's items by range in
        one round (those whose chunks are not cached)."""
        if self._blocks is None and len(runs) > 1:
            self._reader.expect(*self.index.locate_many(np.concatenate(runs)))

    def _lead_batch(self, keys: np.ndarray) -> Any:
        """The batch of units ``keys`` (from :meth:`_lead`), built here: the same bytes a
        worker would send (its items read by range on a cold cache, assembled from the
        mapped chunks on a warm one). Range-read items are compared with their chunks at
        :meth:`_lead_done`. The chunks stay open from the first lead batch to the last
        (a shuffled epoch's two draw from one window), and are released after it, before
        the workers are forked."""
        pool = self._batch_pool(batches.MAIN_ROW, here=True)
        opened: dict[int, None] | None = self.__dict__.get("_lead_open")
        if opened is None:  # the first lead batch of this epoch
            opened = self.__dict__["_lead_open"] = {}
        # Forms learned anew: a chunk's second ask sweeps every item's header, work the
        # workers would not inherit (the second lead batch took 4 ms longer).
        self.__dict__["_forms"] = collections.OrderedDict()
        self._lead_batches = self.__dict__.get("_lead_batches", 0) + 1
        last = self._lead_batches >= self.__dict__.get("_lead_last", 0)
        # One intra-op thread, as in a DataLoader worker: collating 64 items on torch's
        # OpenMP pool took 3-20x longer than on one thread on a busy 2-core machine.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        built = False
        try:
            out = self._batch(keys, pool, batches.MAIN_ROW)
            built = True
            return out
        finally:
            opened.update(dict.fromkeys(self._chunks_of(keys).tolist()))
            if last:
                self._head_go()  # the lead batches are built: their reads are in
            torch.set_num_threads(threads)
            if last or not built:
                # The batches are copies: no chunk stays mapped or pinned here for the epoch.
                self.__dict__.pop("_forms", None)
                for ci in self.__dict__.pop("_lead_open", {}):
                    self._reader.release(ci)
            self._report_stats()

    def _lead_done(self, no: int) -> None:
        """The epoch of lead ``no`` (``_lead_no`` after its :meth:`_lead`) is over:
        compare the items it read by range with their chunks (those in the cache now) and
        drop its mappings. Workers that start later (another loader's) start at the
        epoch's beginning again. Nothing, when a later lead has begun meanwhile (an epoch
        closed late by a thread that was inside it): that one's end does it all."""
        if no != self._lead_no:
            return
        self._head = 0
        self._publish()
        self._head_stop()
        try:
            self._reader.close()
        finally:
            self._report_stats()

    def _chunks_of(self, keys: np.ndarray) -> np.ndarray:
        if self._blocks is not None:
            return self._blocks.chunks_of(keys)
        return self.index.locate_many(keys)[0]

    def _batch(self, keys: np.ndarray, pool: batches.Pool, row: int) -> Any:
        """The batch of units ``keys``: assembled into one buffer when their leaves fit,
        else the items read one by one and collated by ``default_collate``."""
        row = pool.row  # counted on the row this process holds, not the one it preferred
        n = len(keys)
        if self._blocks is not None:
            tb = self._blocks
            tform = Form(("leaf", 0), (Leaf("a", tb.dtype.str, (tb.block_size,)),))
            if not batches.supported(tform):
                return self._collated(keys, row)
            buf, slot = self._buffer(tform, n, pool)
            tb.assemble_into(
                self._reader,
                keys,
                buf.numpy()[: tb.dtype.itemsize * tb.block_size * n]
                .view(tb.dtype)
                .reshape(n, tb.block_size),
            )
            return self._send(tform, n, buf, slot, pool, row)
        chunks, positions = self.index.locate_many(keys)
        self._reader.expect(chunks, positions)  # the first batch: items by range
        early = getattr(self._reader, "_early", None)  # items read by range, by chunk
        if early and any(c in early for c in dict.fromkeys(chunks.tolist())):
            return self._collated(keys, row, chunks, positions)  # items read by range
        parts = []
        form: Form | None = None
        for c in dict.fromkeys(chunks.tolist()):
            sel = np.nonzero(chunks == c)[0]
            cf = self._chunk_forms(c)
            pos = positions[sel]
            f = cf.form_of(pos)
            if f is None or (form is not None and f != form):
                return self._collated(keys, row, chunks, positions)
            form = f
            parts.append((cf, pos, sel))
        assert form is not None
        if not batches.supported(form):
            return self._collated(keys, row, chunks, positions)
        buf, slot = self._buffer(form, n, pool)
        assemble_into(buf.numpy(), form, parts, n)
        return self._send(form, n, buf, slot, pool, row)

    def _buffer(self, form: Form, n: int, pool: batches.Pool) -> tuple[torch.Tensor, int]:
        slot, buf = pool.take(form.regions(max(n, self.batch_size))[1])
        return buf, slot

    def _send(
        self, form: Form, n: int, buf: torch.Tensor, slot: int, pool: batches.Pool, row: int
    ) -> Any:
        batches.count(self._busy, row, "assembled")
        return pool.send(form, n, slot, buf)

    def _collated(
        self,
        keys: np.ndarray,
        row: int,
        chunks: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> Any:
        """The per-item path: what a DataLoader worker collating these items returns."""
        batches.count(self._busy, row, "collated")
        if self._blocks is not None:
            items = list(self._blocks.read_many(self._reader, keys))
        else:
            assert chunks is not None and positions is not None
            pairs = zip(chunks.tolist(), positions.tolist(), strict=True)
            items = [self._reader.read(ci, pos) for ci, pos in pairs]
        return default_collate(items)

    def _chunk_forms(self, chunk: int) -> ChunkForms:
        forms: collections.OrderedDict[int, ChunkForms] = self.__dict__["_forms"]
        mm, offsets = self._reader.mapped(chunk)
        cf = forms.get(chunk)
        if cf is None or cf.buf is not mm:
            cf = forms[chunk] = ChunkForms(mm, offsets)
            while len(forms) > self._open_chunks:
                forms.popitem(last=False)
        forms.move_to_end(chunk)
        return cf

    def _read_units(self, keys: np.ndarray) -> tuple[np.ndarray, Iterator[Any]]:
        """The chunk each unit of ``keys`` starts in, and the units read one by one."""
        if self._blocks is not None:
            return self._blocks.chunks_of(keys), self._blocks.read_many(self._reader, keys)
        chunks, positions = self.index.locate_many(keys)
        self._reader.expect(chunks, positions)  # the first batch: items by range
        pairs = zip(chunks.tolist(), positions.tolist(), strict=True)
        return chunks, (self._reader.read(ci, pos) for ci, pos in pairs)

    def _plan_epoch(self, pr: _Progress, world: distributed.World, logical: int) -> None:
        """Tell the source which part of the node's epoch this reader reads."""
        self.source.plan_epoch(
            epoch=pr.epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            window=self.shuffle_window,
            remaining=pr.base(self.epoch_total),
            received=pr.received,
            world=world.world_size,
            rank=world.rank,
            num_workers=pr.num_workers,
            worker=logical,
            batch_size=pr.batch_size,
            drop_last=self.drop_last,
            skipped=self._skip + self.__dict__.get("_ahead", 0),
            subsample=self.subsample,
            epoch_size=self.epoch_size,
            units=self.units,
        )

    def _hint(self, order: ReadOrder, segments: Any, seg: Any, a: int, chunks: np.ndarray) -> None:
        """Tell the downloader which chunks this worker needs next, in order (unless the
        source follows the epoch plan, which knows that already)."""
        if not self.source.remote or self.source.planned:
            return
        depth = self.source.downloader().window_depth(self.source.mean_chunk_bytes)
        want = depth + self.shuffle_window
        seen: dict[int, None] = dict.fromkeys(chunks.tolist())
        end = min(seg.end, a + _BLOCK)
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

    # -- resume --------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return self.source.url

    def _identity(self) -> dict[str, Any]:
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

    def state_dict(
        self,
        received: int | None = None,
        num_workers: int | None = None,
        batch_size: int | None = None,
    ) -> dict[str, Any]:
        """Where this epoch stands, in constant size (no per-sample lists).

        Args:
            received: samples this rank's consumer received since this epoch (or its
                resumed part) started; ``CacheDataLoader`` passes it. Iterating the
                dataset directly, it counts what it yielded itself. Inside a DataLoader
                worker (a stateful loader such as torchdata's ``StatefulDataLoader``
                asks each worker), it is that worker's own position.
            num_workers, batch_size: how the consumer's DataLoader was set up.

        Raises:
            ResumeStateError: called in the main process after DataLoader workers
                iterated this dataset: this copy never saw what they yielded.
        """
        if received is None and get_worker_info() is not None:
            return self._worker_state()
        if received is None:  # iterated directly: one worker, one sample at a time
            if int(self._counters()[0]) != self._expect:
                raise ResumeStateError(
                    f"{self.source.url}: this StreamingDataset was iterated by DataLoader "
                    "worker processes, so this process doesn't know what they yielded and "
                    "its state_dict() would restart the epoch; iterate it with "
                    "CacheDataLoader and save CacheDataLoader.state_dict() instead"
                )
            num_workers, batch_size, received = 1, 1, self._yielded
        world = self._world(num_workers)
        pr = self._progress.adapted(
            world.world_size,
            max(1, num_workers or world.num_workers),
            batch_size or self.batch_size,
            self.epoch_total,
            self.drop_last,
        )
        return {
            "version": STATE_VERSION,
            **self._identity(),
            "epoch": pr.epoch,
            "remaining": [list(r) for r in pr.base(self.epoch_total)],
            "world": pr.world,
            "num_workers": pr.num_workers,
            "batch_size": pr.batch_size,
            "received": pr.received + int(received),
        }

    def _worker_state(self) -> dict[str, Any]:
        """This DataLoader worker's position: the epoch part it runs and how many items of
        its own run it yielded (what a stateful DataLoader saves per worker)."""
        info = get_worker_info()
        assert info is not None
        pr = self._progress
        return {
            "version": STATE_VERSION,
            **self._identity(),
            "epoch": pr.epoch,
            "remaining": None if pr.remaining is None else [list(r) for r in pr.remaining],
            "world": pr.world,
            "num_workers": pr.num_workers,
            "batch_size": pr.batch_size,
            "received": pr.received,
            "worker": info.id,
            "workers": info.num_workers,
            "yielded": self._skip + self._yielded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the samples ``state`` says were received.

        Works with another world size or worker count than the state was saved with
        (except a single worker's state, which a stateful DataLoader hands back to the
        same worker of the same worker count).

        Raises:
            ResumeStateError: the state belongs to another dataset, seed or shuffle setting.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ResumeStateError(f"not a {type(self).__name__} state")
        for key, mine in {"item_loader": None, **self._identity()}.items():
            if state.get(key) != mine:
                raise ResumeStateError(
                    f"{self._name}: the state was saved with {key}={state.get(key)!r}, "
                    f"this dataset has {key}={mine!r}; it can't continue that epoch"
                )
        if "worker" in state:
            self._load_worker_state(state)
            return
        pr = _Progress(
            epoch=int(state["epoch"]),
            remaining=tuple((int(a), int(b)) for a, b in state["remaining"]),
            world=int(state["world"]),
            num_workers=int(state["num_workers"]),
            batch_size=int(state["batch_size"]),
            received=int(state["received"]),
        )
        rest = consumed_to_remaining(
            pr.base(self.epoch_total),
            world=pr.world,
            num_workers=pr.num_workers,
            batch_size=pr.batch_size,
            drop_last=self.drop_last,
            received=pr.received,
        )
        # An epoch whose consumer got everything continues with the next epoch.
        self._progress = pr if rest else _Progress(epoch=pr.epoch + 1)
        self._head = 0
        self._world()
        self._set_counters(self._progress.epoch)
        self._publish()

    def _load_worker_state(self, state: dict[str, Any]) -> None:
        info = get_worker_info()
        here = (info.id, info.num_workers) if info is not None else (0, 1)
        if (state["worker"], state["workers"]) != here:
            raise ResumeStateError(
                f"{self.source.url}: the state is DataLoader worker {state['worker']} of "
                f"{state['workers']}'s position, loaded into worker {here[0]} of {here[1]}; "
                "resume with the same num_workers, or use CacheDataLoader, whose state "
                "resumes with any worker count"
            )
        remaining = state["remaining"]
        pr = _Progress(
            epoch=int(state["epoch"]),
            remaining=None if remaining is None else tuple((int(a), int(b)) for a, b in remaining),
            world=int(state["world"]),
            num_workers=int(state["num_workers"]),
            batch_size=int(state["batch_size"]),
            received=int(state["received"]),
        )
        self._progress = pr
        self._pending = (pr, int(state["yielded"]))

    # -- lifetime ------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_order_cache", None)  # rebuilt where it is used
        for key in ("_pool", "_pool_pid", "_forms", "_heads"):  # a process's own
            state.pop(key, None)
        return state

    def close(self) -> None:
        """Drop this process's mappings, pins, downloads and HTTP session. Idempotent.

        Garbage collection does the same; a closed dataset reconnects if used again.
        """
        self._reader.close()
        self.source.close()

    def __enter__(self) -> StreamingDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
