"""``EpochDataset``: what every streamed dataset does with positions, epochs and workers.

A dataset read in epochs (:class:`~asynccache.torch.streaming.StreamingDataset`, one
dataset; :class:`~asynccache.torch.mixed.MixedDataset`, a mix of several) splits each
epoch's positions over ranks x DataLoader workers, shares the epoch it runs with its
workers (:mod:`.shared_epoch`), yields items or whole batches, builds an epoch's first
batches in the main process when its loader asks (:mod:`.lead`), and saves and loads
its position exactly (:class:`~asynccache.sampling.progress.Progress`).

This class is the template: a subclass says what an epoch's order is, how units are
read, how a batch is built and how its source plans (the hooks at the end). Invariants:

* the order of epoch ``e`` is a pure function of the dataset, its order settings and
  ``e``; which positions a worker reads is a pure function of the published plan;
* the epoch is split over *data-parallel* ranks (:class:`~.distributed.DataParallel`):
  ranks that play one DP rank (a tensor-parallel group) read the same positions and save
  equal states;
* a step (one batch of the consumer) is a position of a few integers
  (:mod:`asynccache.sampling.steps`): a state for step ``S`` costs nothing that grows with
  ``S`` (:meth:`EpochDataset.state_for_step`);
* ``received`` in a state counts what the consumer received, never what was prefetched;
* every process that is not one of this dataset's DataLoader workers owns its shared
  block (:meth:`SharedEpoch.own`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..bridge import lifeline
from ..config import Settings
from ..errors import ConfigError
from ..read.batchread import Form
from ..sampling import Plan, Segment, plan
from ..sampling.progress import Progress, position_state, progress_at, worker_part
from ..sampling.state import DatasetPosition, check_dataset_state, check_worker_slot
from ..sampling.steps import Layout
from . import batches, distributed
from .lead import FirstBatches, LeadStats, lead_runs, one_thread
from .shared_epoch import SharedEpoch, WorkerPlan

__all__ = ["STATE_VERSION", "EpochDataset", "LeadStats"]

STATE_VERSION = 1
BLOCK = 512  # positions materialised at a time; bounds memory per worker


class EpochDataset(IterableDataset[Any]):
    """Positions of an epoch split over ranks x workers, shared with the workers, resumable.

    Each new ``iter()`` runs the next epoch (0, 1, 2, ...) unless :meth:`set_epoch` named
    the epoch it runs, whether the dataset is iterated directly, through a plain
    ``torch.utils.data.DataLoader`` (also with ``persistent_workers=True``) or through
    ``CacheDataLoader`` (which also tracks what was consumed, for resume). Under
    ``torch.distributed`` every rank yields the same number of samples.

    Args (shared by the datasets):
        data_parallel: ``(dp_rank, dp_size)``, or the ``torch.distributed`` process group
            of this rank's data-parallel peers: the epoch is split over these, and every
            rank of one DP rank (a tensor- or sequence-parallel group) reads the same
            batches in the same order. None: each global rank is its own DP rank.
        replication: consecutive groups of this many global ranks read the same data
            (instead of ``data_parallel``).
        reads: False for a rank that reads no data (a pipeline stage after the first):
            it fetches nothing, ``len()`` and states work, iterating it raises
            ``ConfigError``.
    """

    #: Fields a subclass's states carry beyond the common ones (it checks them itself).
    STATE_EXTRA: tuple[str, ...] = ()
    shuffle: bool
    seed: int

    def __init__(
        self,
        settings: Settings,
        drop_last: bool,
        batch_size: int,
        where: str,
        *,
        data_parallel: Any = None,
        replication: int | None = None,
        reads: bool = True,
    ) -> None:
        self.settings = settings
        self.drop_last = drop_last
        self.reads = bool(reads)
        self.data_parallel = distributed.DataParallel(data_parallel, replication)
        self._batch_size = batch_size
        self._num_workers: int | None = None  # set by CacheDataLoader; else from torch
        self._batch_drop_last = False  # the consumer drops a short last batch
        self._progress = Progress()
        self._yielded = 0
        self._rank_world = self.data_parallel.resolve()
        # The DP ranks each node reads (None: one node), worked out once, here: it may
        # gather over the process group, which every rank reaches when it makes the dataset.
        self._nodes = distributed.node_layout(self.data_parallel, self._rank_world, self.reads)
        # None: each worker yields items (the DataLoader collates them); else each worker
        # yields whole batches of batch_size (the value: drop a short last batch).
        self._batch_mode: bool | None = None
        # Samples of this epoch the main process handed out itself before its DataLoader
        # workers started (CacheDataLoader's first batches): the workers begin after them.
        self._head = 0
        self._led = 0  # epochs whose first batches this process built
        self._lead_batches = 0  # batches built here, all epochs
        self._lead_no = 0  # the latest lead (an epoch whose first batches were built here)
        self._lead_last = 0  # _lead_batches once the latest lead's batches are built
        self._lead_open: dict[int, None] | None = None  # chunks a lead's batches opened
        self._pending: tuple[Progress, int] | None = None  # a worker's loaded state
        self._skip = 0  # positions this worker had read of its part before a resume
        self._ahead = 0  # positions of its part the main process handed out (see __iter__)
        self._new_busy()
        self.shared_epoch = SharedEpoch(where)
        self._publish()

    # -- configuration shared with the workers -------------------------------------
    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = value
        if "shared_epoch" in self.__dict__:
            self._publish()

    @property
    def num_workers(self) -> int | None:
        """The consumer's DataLoader worker count (None: as torch reports it)."""
        return self._num_workers

    @num_workers.setter
    def num_workers(self, value: int | None) -> None:
        self._num_workers = value
        if "shared_epoch" in self.__dict__:
            self._publish()

    @property
    def batch_drop_last(self) -> bool:
        """The consumer drops a rank's short last batch (``CacheDataLoader``'s
        ``drop_last``, which sets it): steps count the batches it receives."""
        return self._batch_drop_last

    @batch_drop_last.setter
    def batch_drop_last(self, value: bool) -> None:
        changed = self._batch_drop_last != bool(value)
        self._batch_drop_last = bool(value)
        if changed and "shared_epoch" in self.__dict__:
            self._publish()

    def set_batch_mode(self, drop_last: bool | None) -> None:
        """Make the workers yield whole batches of ``batch_size`` (``drop_last``: drop a
        short last batch), or items (None). ``CacheDataLoader`` sets it."""
        self._batch_mode = drop_last
        self._publish()

    def _world(self, num_workers: int | None = None) -> distributed.World:
        """This reader's place: its data-parallel rank and size, worker and workers."""
        if get_worker_info() is None:  # the main process sees the process group
            self._rank_world = self.data_parallel.resolve()
        return distributed.current(
            num_workers or self.num_workers,
            captured=self._rank_world,
            nodes=self.__dict__.get("_nodes"),
        )

    def dp_rank_and_world(self) -> tuple[int, int]:
        """The data-parallel rank and size this dataset reads as."""
        w = self._world()
        return w.rank, w.world_size

    def _own(self) -> None:
        if self.shared_epoch.own(get_worker_info() is not None):
            self._new_busy()

    def _publish(self) -> None:
        """Write what a worker needs to run an epoch where every worker reads it."""
        if get_worker_info() is not None:
            return
        self._own()
        self.shared_epoch.publish(
            WorkerPlan(
                self._progress,
                self.batch_size,
                self.num_workers,
                self._rank_world,
                self._nodes,
                self._batch_mode,
                self._head,
                self._batch_drop_last,
                self._published(),
            )
        )

    def _sync(self) -> None:
        """In a worker: take the plan the main process published."""
        got = self.shared_epoch.plan()
        self._progress, self._rank_world, self._nodes = got.progress, got.rank_world, got.nodes
        self.batch_size, self.num_workers = got.batch_size, got.num_workers
        self._batch_mode, self._head = got.batched, got.head
        self._batch_drop_last = got.batch_drop_last
        self._synced(got.extra)

    # -- epochs --------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._progress.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` from its beginning (drops a partially
        resumed one). Without it, each ``iter()`` runs the epoch after the previous one."""
        self._progress = Progress(epoch=epoch)
        self._head = 0
        self._world()  # capture rank and world size for the DataLoader workers
        self._own()
        self.shared_epoch.set_epoch(epoch)
        self._publish()

    def _take_epoch(self, pinned: int | None = None) -> int:
        """The epoch this ``iter()`` runs, and advance the counters past it (iterated in
        this process: worker 0 of 1). ``pinned``: the epoch it must run."""
        info = get_worker_info()
        w, nw = (0, 1) if info is None else (info.id, info.num_workers)
        self._own()
        return self.shared_epoch.take_epoch(w, nw, pinned)

    def _plan(self, world: distributed.World) -> tuple[Progress, Plan]:
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

    def __len__(self) -> int:
        """Samples this rank yields in the (rest of the) current epoch."""
        pr, p = self._plan(self._world())
        return p.rank_samples - pr.received

    def check_reads(self) -> None:
        """Raises ``ConfigError`` when this dataset was made with ``reads=False``."""
        if not self.reads:
            raise ConfigError(
                f"{self._name}: this {type(self).__name__} was made with reads=False (a rank "
                "that reads no data, such as a pipeline stage after the first): it is not "
                "iterated; len() and state_dict() / load_state_dict() still work"
            )

    def __iter__(self) -> Iterator[Any]:
        self.check_reads()
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
            # A worker starting after batches the main process built runs the epoch they
            # came from (another loader's workers may have moved the counters on).
            epoch = self._take_epoch(self._progress.epoch if in_worker and self._head else None)
            self._skip = 0
            if self._progress.epoch != epoch:
                self._progress = Progress(epoch=epoch)
                self._head = 0  # handed out of another epoch
            if not in_worker:
                self._publish()
        world = self._world()
        pr, p = self._plan(world)
        head = self._head if in_worker and pending is None else 0
        part = worker_part(pr, p, worker=world.worker, head=head, skip=self._skip)
        self._ahead = part.ahead
        order = self._order()
        self._plan_epoch(pr, world, part.logical)
        if head and pr.num_workers > 1:
            # The main process built this epoch's first batches: the consumer has them
            # while this worker starts, and the worker's chunks start downloading now, not
            # after range reads of its first batch (a round trip for headers, one for
            # items, a GET per item when shuffled).
            self._skip_range_reads()
        self._yielded = 0
        if self._batch_mode is not None:
            yield from self._iter_batches(order, part.segments, self._batch_mode)
        else:
            yield from self._iter_items(order, part.segments)

    def _blocks(self, order: Any, segments: list[Segment]) -> Iterator[tuple[Segment, int, Any]]:
        """The positions of ``segments`` in blocks of :data:`BLOCK`: each block's segment,
        first position and keys (the download counters reported before each)."""
        for seg in segments:
            for a in range(seg.start, seg.end, BLOCK):
                self._report_stats()
                yield seg, a, order.keys(a, min(seg.end, a + BLOCK))

    def _iter_items(self, order: Any, segments: list[Segment]) -> Iterator[Any]:
        # The reader's one round of range reads an epoch covers the items of the first
        # call: the first batch's alone, which is what it is there for (the DataLoader
        # collates nothing before its last item; more items by range only hold the
        # chunk downloads back longer). A batch size of 1 is the default of a dataset no
        # loader told its batch size: the whole first block, within the byte budget.
        first = self.batch_size if self.batch_size > 1 else 0
        try:
            for seg, a, keys in self._blocks(order, segments):
                runs = [keys[:first], keys[first:]] if 0 < first < len(keys) else [keys]
                first = 0
                hinted = False
                for run in runs:
                    chunks, items = self._read_units(run)
                    for item in items:
                        if not hinted:  # after the first read: it had the bandwidth to itself
                            whole = chunks if len(runs) == 1 else self._chunks_of(keys)
                            self._hint(order, segments, seg, a, whole)
                            hinted = True
                        self._yielded += 1
                        yield item
        finally:
            self._end_iteration()

    def _iter_batches(self, order: Any, segments: list[Segment], drop_last: bool) -> Iterator[Any]:
        """This worker's part in batches of ``batch_size``: the same batches, in the same
        order, that a DataLoader collating its items with ``default_collate`` makes."""
        bs = self.batch_size
        info = get_worker_info()
        # A worker's row of busy marks (the main process, iterating itself: the last row).
        row = batches.MAIN_ROW if info is None else info.id % batches.MAIN_ROW
        pool = self._batch_pool(row, here=info is None)
        self._forget_forms()
        pending: list[np.ndarray] = []
        held = 0
        try:
            for seg, a, keys in self._blocks(order, segments):
                pending.append(keys)
                held += len(keys)
                hinted = False
                while held >= bs:
                    run = np.concatenate(pending)
                    pending, held = [run[bs:]], len(run) - bs
                    out = self._batch(run[:bs], pool, row, ahead=keys)
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
                out = self._batch(run, pool, row, ahead=run)
                self._yielded += len(run)
                yield out
        finally:
            self._end_iteration()

    def _end_iteration(self) -> None:
        self._forget_forms()
        self._settle()
        self._report_stats()
        self._close_reading()

    # -- whole batches (docs/streaming.md, "Batches") ---------------------------------
    def _new_busy(self) -> None:
        """A fresh block of busy marks for pooled batch buffers (see :mod:`.batches`)."""
        self.batch_marks = batches.shared_bytes(batches.BLOCK_BYTES)
        self._busy_token = secrets.token_hex(8)
        batches.register(self._busy_token, self.batch_marks)

    def batch_stats(self) -> dict[str, int]:
        """Batches this dataset's workers assembled from the chunks (``assembled``) or
        collated from decoded items (``collated``: leaves that don't fit), and the pooled
        / one-off buffers they allocated, summed over every worker."""
        self._own()
        return batches.counters(self.batch_marks)

    def _batch_pool(self, row: int, here: bool) -> batches.Pool:
        """This process's pool of batch buffers (busy-mark row ``row``; ``here``: the
        consumer is this process)."""
        pool = self.__dict__.get("_pool")
        if (
            pool is None
            or pool.block is not self.batch_marks
            or self.__dict__.get("_pool_pid") != os.getpid()
        ):
            pool = self.__dict__["_pool"] = batches.Pool(
                self.batch_marks, self._busy_token, row, here
            )
            self.__dict__["_pool_pid"] = os.getpid()
        return pool

    def worker_pool(self) -> batches.Pool:
        """This DataLoader worker's pool of batch buffers (a ``collate_fn``'s batches
        travel in it too: :mod:`.handover`)."""
        info = get_worker_info()
        return self._batch_pool(0 if info is None else info.id % batches.MAIN_ROW, here=False)

    def _buffer(self, form: Form, n: int, pool: batches.Pool) -> tuple[torch.Tensor, int]:
        slot, buf = pool.take(form.regions(max(n, self.batch_size))[1])
        return buf, slot

    def _send(
        self,
        form: Form,
        n: int,
        buf: torch.Tensor,
        slot: int,
        pool: batches.Pool,
        row: int,
        objects: list[Any] | None = None,
    ) -> Any:
        """Hand the batch in ``buf`` over (``objects``: its str and bytes leaves' values,
        from :func:`~asynccache.read.batchread.assemble_into`)."""
        batches.count(self.batch_marks, row, "assembled")
        return pool.send(form, n, slot, buf, objects)

    # -- the first batches, built in the main process (:mod:`.lead`) -------------------
    @property
    def lead_stats(self) -> LeadStats:
        """The epochs whose first batches this process built, and the batches it built."""
        return LeadStats(self._led, self._lead_batches)

    def first_batches(self) -> FirstBatches | None:
        """In the main process, before the DataLoader workers start: the batches this rank
        receives next, to be built here (:mod:`.lead`); the workers then leave them out.
        None, and the workers start as usual, unless whole batches come from the workers
        and more than one batch of this rank's epoch is left."""
        led = self._lead()
        if led is None:
            return None
        runs, busy = led
        no = self._lead_no
        # (Before the workers fork: a buffer borrowed now is never adopted by one of them.)
        self._batch_pool(batches.MAIN_ROW, here=True).borrow_idle(len(runs), busy)
        return FirstBatches(
            runs,
            self.settings.worker_start_s,
            far_link=self._far_link,
            long_copy=self._lead_long_copy(runs),
            expect=lambda: self._lead_expect(runs),
            build=self._lead_batch,
            before_fork=self._plan_node,
            stop_head=self._head_stop,
            done=lambda: self._lead_done(no),
        )

    def _lead(self) -> tuple[list[np.ndarray], int] | None:
        """The lead runs, and how many of the workers build a batch in their first round
        after them (the rest build none this epoch)."""
        self._head = 0
        if not self.reads:
            self._publish()
            return None
        pr, p = self._plan(self._world())
        bs = pr.batch_size
        if self._batch_mode is None or p.rank_samples - pr.received <= bs:
            self._publish()
            return None
        order = self._order()
        runs = lead_runs(
            p,
            order,
            pr.received,
            pr.num_workers,
            one_if=self._lead_alone,
            fetches_nothing=self._lead_fetches_nothing,
        )
        if not runs:
            self._publish()
            return None
        self._head = bs * len(runs)
        self._lead_no += 1
        self._led += 1
        self._publish()
        self._lead_last = self._lead_batches + len(runs)
        self._head_start(p, order, pr.received + self._head)
        left = p.rank_samples - pr.received - self._head
        return runs, min(pr.num_workers, -(-left // bs))

    def _lead_batch(self, keys: np.ndarray) -> Any:
        """The batch of units ``keys`` (a lead run), built here: the same bytes a worker
        would send. The chunks stay open from the first lead batch to the last (a shuffled
        epoch's two draw from one window), and are released after it, before the workers
        are forked; forms are learned anew for each batch (work the workers would not
        inherit)."""
        pool = self._batch_pool(batches.MAIN_ROW, here=True)
        if self._lead_open is None:  # the first lead batch of this epoch
            self._lead_open = {}
        self._forget_forms()
        self._lead_batches += 1
        last = self._lead_batches >= self._lead_last
        built = False
        try:
            with one_thread():
                out = self._batch(keys, pool, batches.MAIN_ROW)
            built = True
            return out
        finally:
            self._lead_open.update(dict.fromkeys(self._chunks_of(keys).tolist()))
            if last:
                self._head_go()  # the lead batches are built: their reads are in
            if last or not built:
                # The batches are copies: no chunk stays mapped or pinned here for the epoch.
                self._forget_forms()
                opened, self._lead_open = self._lead_open, None
                self._release_lead(list(opened))
            self._report_stats()

    def _lead_done(self, no: int) -> None:
        """The epoch of lead ``no`` is over: drop its mappings; workers that start later
        (another loader's) start at the epoch's beginning again. Nothing, when a later lead
        has begun meanwhile (an epoch closed late by a thread that was inside it)."""
        if no != self._lead_no:
            return
        self._head = 0
        self._publish()
        self._head_stop()
        try:
            self._close_reading()
        finally:
            self._report_stats()

    # -- statistics ------------------------------------------------------------------
    def _report_stats(self) -> None:
        """Add this process's download counters to its row of the shared table."""
        values = self._source_stats()
        if values is None:
            return
        info = get_worker_info()
        self._own()
        self.shared_epoch.report(None if info is None else info.id, values)

    def download_stats(self) -> dict[str, float]:
        """Download counters summed over this process and every DataLoader worker that
        iterated this dataset (workers report as they go: at least every few hundred
        items and when their iterator ends)."""
        self._report_stats()
        self._own()
        return self.shared_epoch.totals()

    # -- resume --------------------------------------------------------------------
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
            self._own()
            self.shared_epoch.check_state_here(type(self).__name__)
            num_workers, batch_size, received = 1, 1, self._yielded
        world = self._world(num_workers)
        pr = self._progress.adapted(
            world.world_size,
            max(1, num_workers or world.num_workers),
            batch_size or self.batch_size,
            self.epoch_total,
            self.drop_last,
        )
        return self._state(pr, int(received))

    def _state(self, pr: Progress, received: int = 0, fresh: bool = False) -> dict[str, Any]:
        """The state of position ``pr`` after ``received`` more positions (``fresh``: a
        position of an uninterrupted run with this configuration, not this dataset's)."""
        base = pr.base(self.epoch_total)
        return {
            "version": STATE_VERSION,
            **self.identity(),
            **position_state(pr, base, pr.received + received),
            **self._state_extra(pr, fresh),
        }

    # -- steps (docs/parallelism.md, "Seek and skip") ----------------------------------
    def step_layout(self, batch_size: int | None = None, num_workers: int | None = None) -> Layout:
        """How this dataset's epochs become steps for its consumer: its data-parallel
        size, positions per batch, both ``drop_last``s and the DataLoader workers."""
        world = self._world(num_workers)
        return Layout(
            world.world_size,
            batch_size or self.batch_size,
            self.drop_last,
            self._batch_drop_last,
            max(1, num_workers or self.num_workers or world.num_workers),
        )

    def steps_per_epoch(self) -> int:
        """Batches the consumer of each data-parallel rank receives in a whole epoch."""
        return self.step_layout().steps(self.epoch_total)

    def batch_now(self) -> int:
        """The batch of its epoch the consumer is at (what it received of the epoch, in
        batches; for a part resumed with another world or batch size, counted back from
        the end of the epoch)."""
        pr, p = self._plan(self._world())
        return self.step_layout().batch_at(p.rank_samples - pr.received, self.epoch_total)

    def state_for_step(
        self, step: int, num_workers: int | None = None, batch_size: int | None = None
    ) -> dict[str, Any]:
        """The state an uninterrupted run with this configuration saves after ``step``
        batches (counted from epoch 0's first): load it to continue at that step's batch.
        Nothing is read; the cost does not grow with ``step``.

        Raises:
            ConfigError: a negative step, or an epoch too short to have a step.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ConfigError(f"step must be an integer, got {step!r}")
        layout = self.step_layout(batch_size, num_workers)
        try:
            pr = progress_at(layout, int(step), self.epoch_total)
        except ValueError as exc:
            raise ConfigError(f"{self._name}: {exc}") from exc
        return self._state(pr, fresh=True)

    def _worker_state(self) -> dict[str, Any]:
        """This DataLoader worker's position: the epoch part it runs and how many units of
        its own part it yielded (what a stateful DataLoader saves per worker)."""
        info = get_worker_info()
        assert info is not None
        pr = self._progress
        return {
            "version": STATE_VERSION,
            **self.identity(),
            **position_state(pr, pr.remaining, pr.received),
            "worker": info.id,
            "workers": info.num_workers,
            "yielded": self._skip + self._yielded,
            **self._state_extra(pr, False),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the samples ``state`` says were received.

        Works with another world size or worker count than the state was saved with
        (except a single worker's state, which a stateful DataLoader hands back to the
        same worker of the same worker count).

        Raises:
            ResumeStateError: the state belongs to another dataset, seed or shuffle setting.
        """
        pos = check_dataset_state(
            state,
            identity={"item_loader": None, **self.identity()},
            epoch_total=self.epoch_total,
            drop_last=self.drop_last,
            name=self._name,
            extra=self.STATE_EXTRA,
        )
        if pos.worker is not None:
            self._load_worker_state(state, pos)
            return
        pr = pos.progress
        self._load_extra(state, pr)
        # An epoch whose consumer got everything continues with the next epoch.
        left = pr.left(self.epoch_total, self.drop_last)
        self._progress = pr if left else Progress(epoch=pr.epoch + 1)
        self._head = 0
        self._world()
        self._own()
        self.shared_epoch.set_epoch(self._progress.epoch)
        self._publish()

    def _load_worker_state(self, state: dict[str, Any], pos: DatasetPosition) -> None:
        info = get_worker_info()
        here = (info.id, info.num_workers) if info is not None else (0, 1)
        check_worker_slot(pos, here, self._name)
        assert pos.yielded is not None
        self._load_extra(state, pos.progress)
        self._progress = pos.progress
        self._pending = (pos.progress, pos.yielded)

    # -- lifetime ------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_order_cache", "_pool", "_pool_pid"):  # a process's own
            state.pop(key, None)
        return state

    def __enter__(self) -> EpochDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hooks -----------------------------------------------------------------------
    @property
    def _name(self) -> str:
        """The dataset, in messages."""
        raise NotImplementedError

    def _state_extra(self, pr: Progress, fresh: bool) -> dict[str, Any]:
        """More fields of a state at ``pr`` (``fresh``: see :meth:`_state`)."""
        return {}

    def _load_extra(self, state: dict[str, Any], pr: Progress) -> None:
        """Take (and check) the fields :meth:`_state_extra` wrote."""

    def _published(self) -> Any:
        """More of the plan the workers need (JSON-ready)."""
        return None

    def _synced(self, extra: Any) -> None:
        """In a worker: take what :meth:`_published` wrote."""

    @property
    def epoch_total(self) -> int:
        """Positions of one epoch over all ranks."""
        raise NotImplementedError

    @property
    def num_items(self) -> int:
        """Samples of the data (one pass)."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """What a resume state must match: the data and everything that makes its order."""
        raise NotImplementedError

    def batchable(self) -> str | None:
        """Why the workers can't yield whole batches (None: they can)."""
        return None

    def _order(self) -> Any:
        """This epoch's order: ``keys(a, b)`` of positions ``[a, b)``, ``total``, ``epoch``."""
        raise NotImplementedError

    def _read_units(self, keys: np.ndarray) -> tuple[np.ndarray, Iterator[Any]]:
        """The chunk each unit of ``keys`` starts in (for hints), and the samples."""
        raise NotImplementedError

    def _batch(
        self, keys: np.ndarray, pool: batches.Pool, row: int, ahead: np.ndarray | None = None
    ) -> Any:
        """The batch of units ``keys``, as a DataLoader collating them would make it;
        ``ahead``: units this process reads next (the block ``keys`` end in)."""
        raise NotImplementedError

    def _chunks_of(self, keys: np.ndarray) -> np.ndarray:
        """The chunks units ``keys`` start in (none: the source follows its own plan)."""
        raise NotImplementedError

    def _hint(self, order: Any, segments: list[Segment], seg: Segment, a: int, chunks: Any) -> None:
        """Tell the downloader which chunks this reader needs next."""

    def _plan_epoch(self, pr: Progress, world: distributed.World, logical: int) -> None:
        """Tell the source(s) which part of the node's epoch this reader reads."""

    def _skip_range_reads(self) -> None:
        """Read nothing by range this epoch (the main process built this worker's first
        batch)."""

    def _source_stats(self) -> list[float] | None:
        """This process's download counters (:data:`~.shared_epoch.STAT_FIELDS`); None
        when nothing is downloaded."""
        return None

    def _settle(self) -> None:
        """At the end of a worker's iteration: wait for its chunks' publishes."""

    def _forget_forms(self) -> None:
        """Drop the chunk forms learned for batch assembly."""

    def _close_reading(self) -> None:
        """Drop this process's chunk mappings and pins (reopened if read again)."""

    def _lead_alone(self, keys: np.ndarray) -> bool:
        """The first lead batch, of units ``keys``, is built alone (scattered range reads)."""
        return False

    def _lead_fetches_nothing(self, runs: list[np.ndarray]) -> bool:
        """The units of ``runs`` can be read here without downloading a whole chunk."""
        return False

    def _lead_expect(self, runs: list[np.ndarray]) -> None:
        """Before the first of ``runs`` is built: start their reads in one round."""

    def _release_lead(self, chunks: list[int]) -> None:
        """The lead batches are built: release what they opened (``chunks``)."""

    def _far_link(self) -> bool:
        """The main process measured the link as far: start the workers at once."""
        return False

    def _lead_long_copy(self, runs: list[np.ndarray]) -> bool:
        """The lead batches ``runs`` read only cached chunks and are large enough that
        copying them takes longer than forking the workers: those fork first."""
        return False

    def _plan_node(self) -> None:
        """Before the workers fork: plan the node's readers of this epoch here, once,
        for them to inherit."""

    def _head_start(self, p: Plan, order: Any, received: int) -> None:
        """Start the workers' first chunks here (see :class:`~.lead.HeadStart`)."""

    def _head_go(self) -> None:
        """The lead batches are built: the head start may use the connections."""

    def _head_stop(self) -> None:
        """The epoch is over: cancel the head start's downloads nobody took."""

    def cache_usage(self) -> tuple[int, int]:
        """Bytes the local cache directory holds now, and its budget."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop this process's mappings, pins, downloads and sessions. Idempotent."""
