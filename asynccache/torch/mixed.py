"""``MixedDataset``: several :class:`StreamingDataset` streams read as one weighted mix.

The mixed epoch is a sequence of slots dealt to the streams (:mod:`asynccache.sampling.mix`);
the ``k``-th sample of a stream in the epoch reads position ``k`` of that stream's own
epoch order (its shuffle, ``subsample`` and window), wrapped to the count the mix takes
from it. Everything about positions (the rank x worker split, padding, ``drop_last``,
shared epoch counters, exact and elastic resume) is :class:`~.epoch.EpochDataset`'s,
applied to the slots of the mix. The mix holds its streams and reads them through their
public reading interface (:class:`~asynccache.read.units.UnitReader`); each stream's
:class:`~asynccache.read.source.DatasetSource` plans its own reads from the part of its
order that every reader of the node takes (:class:`~asynccache.read.readplan.View`), so
each chunk is downloaded once per node and evicted by the node's plan. All streams share
the cache directory's budget and the process's I/O thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import default_collate, get_worker_info

from ..errors import ConfigError, ResumeStateError
from ..read.batchread import Form
from ..read.readplan import View
from ..sampling import Segment
from ..sampling.mix import (
    MODES,
    MixOrder,
    Schedule,
    ScheduledMix,
    ScheduleSpec,
    Share,
    checked_schedule,
    deal,
    stream_counts,
)
from ..sampling.order import ReadOrder
from ..sampling.partition import received_per_worker
from ..sampling.progress import Progress, drop
from ..sampling.state import check_mix_layout
from ..sampling.steps import Layout
from . import batches, distributed
from .epoch import EpochDataset
from .mix_forms import (
    copy_token_rows,
    fill_rows,
    mixed_items,
    plan_batch,
    tagged,
    token_form,
)
from .shared_epoch import STAT_FIELDS
from .streaming import StreamingDataset, reader_place

__all__ = ["MixedDataset", "Stream"]

log = logging.getLogger(__name__)
_WINDOW = 4096  # samples of the mix located at a time (see MixedDataset._locate)


@dataclasses.dataclass(frozen=True)
class Stream:
    """One dataset of a mix and how much of it an epoch takes: one of ``weight`` (share
    of the weighted samples; the default, 1), ``repeat`` (passes over it per epoch) or
    ``choose`` (samples per epoch)."""

    dataset: StreamingDataset
    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None

    @property
    def share(self) -> Share:
        return Share(self.weight, self.repeat, self.choose)


class _Epoch:
    """The mixed epoch as the position machinery sees it: ``total`` slots."""

    def __init__(self, mix: MixOrder | ScheduledMix, epoch: int) -> None:
        self.mix, self.epoch, self.total = mix, epoch, mix.slots

    def keys(self, start: int, end: int) -> np.ndarray:
        return np.arange(start, end, dtype=np.int64)

    def chunks_of(self, keys: np.ndarray) -> np.ndarray:
        return np.empty(0, dtype=np.int64)


class _MixView:
    """Stream ``s``'s part of a mixed epoch, for its source's read plan (``layout``: the
    layout a scheduled mix deals the epoch by)."""

    def __init__(self, owner: MixedDataset, s: int, layout: Layout | None = None) -> None:
        self.owner, self.s, self.layout = owner, s, layout

    @property
    def total(self) -> int:
        return self.owner.epoch_total

    @property
    def way(self) -> str:
        way = json.dumps(self.owner.identity(), sort_keys=True)
        return way if self.layout is None else f"{way} {self.layout}"

    def project(self, epoch: int) -> Any:
        owner = self.owner

        def project(segs: list[Segment]) -> list[Segment]:
            out: list[Segment] = []
            for seg in segs:
                for a, b in owner.projected(epoch, seg.start, seg.end)[self.s]:
                    out.append(Segment(a, b, seg.pad))
            return out

        return project


class MixedDataset(EpochDataset):
    """Samples of several :class:`StreamingDataset` streams, mixed by weight.

    Iterate it like a :class:`StreamingDataset` (directly, through a DataLoader, or
    through :class:`CacheDataLoader`, whose ``state_dict`` / ``load_state_dict`` resume it
    exactly, also with another worker count or world size). The mix of epoch ``e`` is a
    pure function of (``seed``, ``e``, the streams' sizes and shares): the same on every
    rank. Each stream keeps its own chunk-aware order (its ``shuffle``, ``seed``,
    ``shuffle_window``, ``subsample``), so a mix downloads each chunk no more often than
    reading the streams alone would.

    Args:
        streams: :class:`Stream` entries, or datasets (weight 1 each).
        mode: ``"random"`` (samples interleaved by weight), ``"per_stream"`` (every batch
            from one stream) or ``"stratified"`` (every batch holds the same per-stream
            counts, the batch size apportioned by the streams' shares).
        batch_size: the consumer's batch size; required for ``per_stream`` and
            ``stratified``, whose batches it shapes (a DataLoader over the mix must use
            the same one).
        seed: the seed of the mix (each stream's own order keeps its own seed).
        epoch_size: samples per mixed epoch over all ranks; the weighted streams share
            what the ``repeat``/``choose`` streams leave. Default: the weighted streams'
            own epoch lengths, summed.
        drop_last: as :class:`StreamingDataset` (per slot: a sample, or a batch).
        tag: yield ``(stream number, sample)`` pairs instead of samples.
        schedule: weights that change during the run (a curriculum):
            ``[(step, [w_0, w_1, ...]), ...]`` (global steps, the first at 0; a weight
            holds from its step to the next entry's) or a callable ``f(epoch, step)``
            returning the weights (pure; called for each step of an epoch when its mix
            is built). A step is one batch of one data-parallel rank's consumer, counted
            from epoch 0 (docs/parallelism.md): rank ``r``'s batch at step ``S`` is dealt
            with the weights of step ``S``. Every stream is weighted by the schedule
            (``repeat`` / ``choose`` are refused); the epoch keeps its length. The order
            is a pure function of the seed, the schedule and the split into steps
            (data-parallel size, batch size, ``drop_last``); resuming with another
            schedule raises ``ResumeStateError``.
        data_parallel, replication, reads: as :class:`StreamingDataset`.

    Raises:
        ConfigError: an unknown mode, a missing ``batch_size``, bad shares, a malformed
            schedule.
    """

    STATE_EXTRA = ("layout", "schedule_digest")

    def __init__(
        self,
        streams: Sequence[Stream | StreamingDataset],
        *,
        mode: str = "random",
        batch_size: int | None = None,
        seed: int = 0,
        epoch_size: int | None = None,
        drop_last: bool | None = None,
        tag: bool = False,
        schedule: ScheduleSpec | None = None,
        data_parallel: Any = None,
        replication: int | None = None,
        reads: bool = True,
    ) -> None:
        entries = [s if isinstance(s, Stream) else Stream(s) for s in streams]
        if not entries:
            raise ConfigError("a MixedDataset needs at least one stream")
        for i, e in enumerate(entries):
            if not isinstance(e.dataset, StreamingDataset) or isinstance(e.dataset, MixedDataset):
                raise ConfigError(f"stream {i} of the mix is not a StreamingDataset")
        seen: dict[int, int] = {}
        for i, e in enumerate(entries):
            j = seen.setdefault(id(e.dataset), i)
            if j != i:  # one source can follow one plan: open the dataset twice instead
                raise ConfigError(
                    f"streams {j} and {i} of the mix are the same StreamingDataset object; "
                    "give each stream its own StreamingDataset (the same URL may be opened twice)"
                )
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if mode != "random" and (batch_size is None or batch_size < 1):
            raise ConfigError(f"mode={mode!r} needs batch_size= (the batches it shapes)")
        try:
            self.shares = [e.share for e in entries]
        except ValueError as exc:
            raise ConfigError(f"mix: {exc}") from exc
        self.streams = [e.dataset for e in entries]
        self.mode, self.seed, self.tag = mode, seed, tag
        self.epoch_size = epoch_size
        self.mix_batch = batch_size or 1
        self.unit = 1 if mode == "random" else self.mix_batch  # samples per slot
        lengths = [s.epoch_total for s in self.streams]
        self.schedule: Schedule | None = None
        # [epoch, world, workers, batch, batch_drop_last]: a loaded epoch's layout
        self._pinned: list[Any] | None = None
        if schedule is not None:
            self.schedule = self._check_schedule(schedule)
        try:
            self.counts = stream_counts(lengths, self.shares, epoch_size)
            if self.schedule is None:
                self._slots = self._mix(0).slots
            else:
                self._slots = sum(self.counts) // self.unit
        except ValueError as exc:
            raise ConfigError(f"mix: {exc}") from exc
        if self.schedule is None:
            for i, (s, n) in enumerate(zip(self.streams, self._mix(0).counts, strict=True)):
                if n and not s.num_items:
                    raise ConfigError(f"stream {i} ({s.source.url}) is empty but the mix takes {n}")
        self.shuffle = any(s.shuffle for s in self.streams)
        self.url = "mix(" + ", ".join(s.source.url for s in self.streams) + ")"
        self.remote = any(s.source.remote for s in self.streams)
        super().__init__(
            self.streams[0].settings,
            bool(drop_last),
            self.mix_batch,
            self.url,
            data_parallel=data_parallel,
            replication=replication,
            reads=reads,
        )

    def _check_schedule(self, schedule: ScheduleSpec) -> Schedule:
        names = [st.source.url for st in self.streams]
        sizes = [st.num_items for st in self.streams]
        return checked_schedule(schedule, self.shares, names, sizes)

    # -- the mix -----------------------------------------------------------------------
    def _layout_of(self, epoch: int) -> Layout:
        """The layout a scheduled mix deals epoch ``epoch`` by: the one a loaded state of
        that epoch names, else this configuration's."""
        pin = self._pinned
        if pin is not None and pin[0] == epoch:
            return Layout(pin[1], pin[3], self.drop_last, pin[4], pin[2])
        return self.step_layout()

    def _mix(self, epoch: int) -> MixOrder | ScheduledMix:
        layout = None if self.schedule is None else self._layout_of(epoch)
        # A few epochs' mixes: the read plan also deals the next epoch (a scheduled
        # epoch costs a call of a callable schedule per step to deal).
        cache: dict[Any, Any] = self.__dict__.setdefault("_mix_cache", {})
        mix: MixOrder | ScheduledMix | None = cache.get((epoch, layout))
        if mix is None:
            try:
                mix = deal(
                    self.counts, self.schedule, layout, self.mode, self.mix_batch, self.seed, epoch
                )
            except ValueError as exc:  # weights a callable schedule returned
                raise ConfigError(f"{self._name}: {exc}") from exc
            if len(cache) >= 3:
                cache.pop(next(iter(cache)))
            cache[(epoch, layout)] = mix
        return mix

    def _epoch_size(self, s: int, mix: MixOrder | ScheduledMix) -> int:
        """The length of stream ``s``'s order in an epoch of ``mix``: what the mix takes
        of it; with a schedule, the epoch's samples (the same in every epoch and layout,
        so the stream's read plan keeps one board: its first positions are the same)."""
        return mix.counts[s] if self.schedule is None else mix.total

    def projected(self, epoch: int, start: int, end: int) -> list[list[tuple[int, int]]]:
        """Each stream's ranges of its order that slots ``[start, end)`` of epoch
        ``epoch`` read (:meth:`MixOrder.project`), worked out once for all the streams'
        read plans (each asks for the same segments of the node's readers)."""
        mix = self._mix(epoch)
        memo = self.__dict__.get("_project_memo")
        if memo is None or memo[0] is not mix or len(memo[1]) > 4096:
            fresh: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
            memo = self.__dict__["_project_memo"] = (mix, fresh)
        seen: dict[tuple[int, int], list[list[tuple[int, int]]]] = memo[1]
        got = seen.get((start, end))
        if got is None:
            got = seen[(start, end)] = mix.project([(start, end)])
        return got

    def _order(self) -> _Epoch:
        order = self.__dict__.get("_order_cache")
        if order is None or order.epoch != self._progress.epoch:
            order = _Epoch(self._mix(self._progress.epoch), self._progress.epoch)
            self.__dict__["_order_cache"] = order
        return order

    def _stream_order(self, s: int, epoch: int) -> ReadOrder:
        mix = self._mix(epoch)
        key = ("_stream_orders", epoch, mix.total if self.schedule is not None else None)
        orders = self.__dict__.get("_stream_orders")
        if orders is None or orders[0] != key:
            orders = (
                key,
                [
                    ReadOrder(
                        st.units,
                        dataclasses.replace(st.order_spec, epoch_size=self._epoch_size(i, mix)),
                        epoch,
                    )
                    for i, st in enumerate(self.streams)
                ],
            )
            self.__dict__["_stream_orders"] = orders
        return orders[1][s]

    @property
    def epoch_total(self) -> int:
        """Slots of one mixed epoch over all ranks (samples; batches in ``per_stream``
        and ``stratified`` modes)."""
        return self._slots

    @property
    def num_items(self) -> int:
        """Samples of one mixed epoch over all ranks."""
        return self._slots * self.unit

    @property
    def stream_counts(self) -> list[int]:
        """Samples each stream gives one mixed epoch (with a schedule: the current
        epoch, as this configuration splits it into steps)."""
        return list(self._mix(self._progress.epoch).counts)

    @property
    def batch_size(self) -> int:
        """The batch size of the position machinery: slots per batch (1 when a slot is a
        batch)."""
        return self._batch_size if self.unit == 1 else 1

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if self.unit > 1 and value not in (1, self.mix_batch):
            raise ConfigError(
                f"this {self.mode} mix shapes batches of {self.mix_batch} samples; a loader "
                f"with batch_size={value} would cut across them"
            )
        if self.unit == 1:
            self._batch_size = value
        if "shared_epoch" in self.__dict__:
            self._publish()

    def __len__(self) -> int:
        return super().__len__() * self.unit

    def __getitem__(self, key: int) -> Any:
        raise ConfigError("a MixedDataset is iterated, not indexed; index its streams instead")

    # -- reading -----------------------------------------------------------------------
    def batchable(self) -> str | None:
        """Why the mix's workers can't yield whole batches (None: they can).

        A batch's rows come from the streams the mix names; each stream copies its rows
        straight from its mapped chunks into the rows of one buffer. Per batch, rows
        whose leaves don't share one form (item streams of other forms, a chunk read by
        range) are collated from their items instead (counted in :meth:`batch_stats`).
        """
        for i, st in enumerate(self.streams):
            if st.transform is not None:
                return f"stream {i} of the mix has a per-item transform"
        if self.mode == "per_stream":  # every batch is one stream's: forms may differ
            return None
        token = [st.unit_reader.blocks for st in self.streams]
        forms = {None if t is None else (t.dtype.str, t.block_size) for t in token}
        if len(forms) > 1:
            each = ", ".join(
                f"stream {i}: " + ("items" if t is None else f"{t.block_size} x {t.dtype}")
                for i, t in enumerate(token)
            )
            return f"the mix's streams differ in sample form ({each})"
        return None

    def _chunks_of(self, keys: np.ndarray) -> np.ndarray:
        return np.empty(0, dtype=np.int64)  # (each stream's source follows its own plan)

    def _locate(self, slots: np.ndarray) -> tuple[np.ndarray, ...]:
        """For the samples of ``slots`` in order: the stream of each, the unit key it
        reads in that stream, and where a token block lies (its chunk and byte offset,
        :meth:`TokenUnits.place`; 0 for items). Worked out for a window of the epoch at a
        time (batches of a worker's run take it in slices)."""
        if (slots[1:] - slots[:-1] == 1).all():  # (one run of slots: the usual batch)
            return self._located(int(slots[0]), int(slots[-1]) + 1)
        cuts = np.flatnonzero(np.diff(slots) != 1) + 1  # (a batch may span two segments)
        found = [self._located(int(r[0]), int(r[-1]) + 1) for r in np.split(slots, cuts)]
        return tuple(np.concatenate([f[i] for f in found]) for i in range(4))

    def _located(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """:meth:`_locate` of the slots ``[lo, hi)``."""
        epoch, u = self._progress.epoch, self.unit
        mix = self._mix(epoch)
        win = self.__dict__.get("_window")
        if win is None or win[0] is not mix or not win[1] <= lo <= hi <= win[2]:
            end = min(mix.slots, max(hi, lo + -(-_WINDOW // u)))
            streams, positions = mix.locate(lo * u, end * u)
            keys = np.empty(len(positions), dtype=np.int64)
            chunks = np.zeros(len(positions), dtype=np.int64)
            offsets = np.zeros(len(positions), dtype=np.int64)
            for s, st in enumerate(self.streams):
                rows = np.flatnonzero(streams == s)
                if not len(rows):
                    continue
                mine = positions[rows]  # consecutive (a range of the mix is a range of each)
                runs = np.split(mine, np.flatnonzero(np.diff(mine) != 1) + 1)
                order = self._stream_order(s, epoch)
                k = np.concatenate([order.keys(int(r[0]), int(r[-1]) + 1) for r in runs])
                keys[rows] = k
                blocks = st.unit_reader.blocks
                if blocks is not None:
                    chunks[rows], offsets[rows] = blocks.place(k)
            win = self.__dict__["_window"] = (mix, lo, end, streams, keys, chunks, offsets)
        a, b = (lo - win[1]) * u, (hi - win[1]) * u
        return tuple(w[a:b] for w in win[3:])

    def _read_units(self, keys: np.ndarray) -> tuple[np.ndarray, Iterator[Any]]:
        return np.empty(0, dtype=np.int64), self._read_slots(keys)

    def _read_slots(self, slots: np.ndarray) -> Iterator[Any]:
        if not len(slots):
            return
        streams, keys = self._locate(slots)[:2]
        yield from mixed_items(self.streams, streams, keys, self.tag)

    # -- whole batches (docs/streaming.md, "Mixing") -----------------------------------
    def _batch(
        self, keys: np.ndarray, pool: batches.Pool, row: int, ahead: np.ndarray | None = None
    ) -> Any:
        """The batch of slots ``keys``: each stream copies its rows from its mapped chunks
        into the rows of one buffer; collated from the items when their leaves differ."""
        row = pool.row  # counted on the row this process holds, not the one it preferred
        # The batch loop counts the slots it yields; a mix counts samples (as its
        # per-item path does, and as state_dict expects).
        self._yielded += (self.unit - 1) * len(keys)
        streams, unit_keys, chunks, offsets = self._locate(keys)
        n = len(streams)
        blocks_form = self._blocks_form()
        if blocks_form is not None:  # token streams of one form: every row one slice copy
            return self._token_batch(blocks_form, streams, unit_keys, chunks, offsets, pool, row)
        got = self._plan_batch(streams, unit_keys)
        if got is None:
            return self._mix_collated(streams, unit_keys, row)
        inner, parts, blocks = got
        form, buf, slot, body = self._tagged_buffer(inner, streams, pool)
        fill_rows(body, inner, parts, blocks, n)
        return self._send(form, n, buf, slot, pool, row)

    def _tagged_buffer(
        self, inner: Form, streams: np.ndarray, pool: batches.Pool
    ) -> tuple[Form, Any, int, np.ndarray]:
        """A pooled buffer for ``len(streams)`` samples of form ``inner``: the batch's form,
        the buffer, its slot, and the bytes the samples go in. With ``tag`` the samples are
        (stream, sample) pairs, and the int64 tags are written here, ahead of the body."""
        n = len(streams)
        form, shift = inner, 0
        if self.tag:
            form = tagged(inner)
            shift = form.regions(n)[0][1]
        buf, slot = self._buffer(form, n, pool)
        out = buf.numpy()
        if self.tag:
            out[: 8 * n].view(np.int64)[:] = streams
        return form, buf, slot, out[shift:]

    def _blocks_form(self) -> Form | None:
        """The form of the mix's samples when every stream is a token stream of one block
        size and dtype (None: otherwise)."""
        got = self.__dict__.get("_blocks_form_cache")
        if got is None:
            got = self.__dict__["_blocks_form_cache"] = (token_form(self.streams),)
        return got[0]

    def _token_batch(
        self,
        inner: Form,
        streams: np.ndarray,
        unit_keys: np.ndarray,
        chunks: np.ndarray,
        offsets: np.ndarray,
        pool: batches.Pool,
        row: int,
    ) -> Any:
        """A batch of token blocks: each row one slice copy from its stream's mapped chunk
        (:func:`~.mix_forms.copy_token_rows`)."""
        form, buf, slot, body = self._tagged_buffer(inner, streams, pool)
        copy_token_rows(self.streams, body, streams, unit_keys, chunks, offsets)
        return self._send(form, len(streams), buf, slot, pool, row)

    def _plan_batch(self, streams: np.ndarray, unit_keys: np.ndarray) -> Any:
        return plan_batch(self.streams, streams, unit_keys)

    def _mix_collated(self, streams: np.ndarray, unit_keys: np.ndarray, row: int) -> Any:
        """The per-item path: what a DataLoader worker collating these samples returns."""
        batches.count(self.batch_marks, row, "collated")
        return default_collate(list(mixed_items(self.streams, streams, unit_keys, self.tag)))

    # -- the streams' reading ------------------------------------------------------------
    def _forget_forms(self) -> None:
        for st in self.streams:
            st.unit_reader.forget_forms()

    def _close_reading(self) -> None:
        for st in self.streams:
            st.unit_reader.close()

    def _source_stats(self) -> list[float] | None:
        if not self.remote:
            return None
        out = [0.0] * len(STAT_FIELDS)
        for st in self.streams:
            stats = st.source.stats
            for i, f in enumerate(STAT_FIELDS):
                out[i] += float(getattr(stats, f))
        return out

    def _settle(self) -> None:
        """At the end of a DataLoader worker's iteration: wait (bounded) for the publishes
        of the chunks its streams read (see :meth:`StreamingDataset._settle`)."""
        if get_worker_info() is None or not self.remote:
            return
        done = [st.source.wait_published() for st in self.streams if st.source.remote]
        if not all(done):
            log.warning(
                "%s: chunk publishes still running %gs after this DataLoader worker's "
                "iteration ended (ASYNCCACHE_TIMEOUT_S); if the worker is ended before they "
                "finish, those chunks are not cached and will be downloaded again",
                self.url,
                self.settings.timeout_s,
            )

    def cache_usage(self) -> tuple[int, int]:
        """Bytes the local cache directory holds now, and its budget (the first remote
        stream's cache; the streams share one)."""
        for st in self.streams:
            if st.source.remote:
                return st.cache_usage()
        return self.streams[0].cache_usage()

    # -- the first batches, built in the main process (docs/streaming.md) --------------
    def _lead_fetches_nothing(self, runs: list[np.ndarray]) -> bool:
        """The slots of ``runs`` read only chunks in the cache (a mix's first batches are
        built here from cached chunks only: its streams' items are not read by range)."""
        streams, keys = self._locate(np.concatenate(runs))[:2]
        for s, st in enumerate(self.streams):
            k = keys[streams == s]
            if len(k) and not st.unit_reader.all_landed(k):
                return False
        return True

    def _release_lead(self, chunks: list[int]) -> None:
        self._close_reading()  # no stream keeps a chunk mapped or pinned here

    def _skip_range_reads(self) -> None:
        for st in self.streams:
            st.unit_reader.skip_range_reads()

    def _plan_epoch(self, pr: Progress, world: distributed.World, logical: int) -> None:
        if not self.remote:
            return
        mix = self._mix(pr.epoch)
        skipped = np.zeros(len(self.streams), dtype=np.int64)
        # Positions of its part this reader skips: its own resume, and the batches the
        # main process built before the workers started (see EpochDataset.__iter__).
        left = self._skip + self._ahead
        if left:
            p = self._plan(world)[1]
            got = received_per_worker(p.rank_samples, pr.num_workers, pr.batch_size, pr.received)
            for seg in drop(p.workers[logical], got[logical]):
                take = min(left, len(seg))
                for s, ranges in enumerate(mix.project([(seg.start, seg.start + take)])):
                    skipped[s] += sum(b - a for a, b in ranges)
                left -= take
                if not left:
                    break
        place = reader_place(pr, self.epoch_total, world, logical, self.drop_last)
        layout = None if self.schedule is None else self._layout_of(pr.epoch)
        for s, st in enumerate(self.streams):
            if not st.source.remote:
                continue
            view: View = _MixView(self, s, layout)
            spec = st.epoch_spec(place, epoch_size=self._epoch_size(s, mix), view=view)
            st.source.plan_epoch(spec, skipped=int(skipped[s]))
        self._check_budget()

    def _check_budget(self) -> None:
        """The streams share one cache budget: it must hold all their plans' minimums at
        once (each stream's own minimum was checked by its source)."""
        remote = [st for st in self.streams if st.source.remote]
        mins = [st.source.plan_min_bytes for st in remote]
        stores = [store for store in (st.source.store for st in remote) if store is not None]
        if not stores or all(store.fits(sum(mins)) for store in stores):
            return
        budget = min(store.budget() for store in stores)
        mib = 1 << 20
        each = ", ".join(f"{st.source.url}: {m}" for st, m in zip(remote, mins, strict=True))
        raise ConfigError(
            f"{self._name}: the cache budget (ASYNCCACHE_MAX_CACHE_BYTES / max_cache_bytes, "
            f"or less where the file system holds less: {budget} bytes, "
            f"{budget / mib:.1f} MiB) is below the sum of the mixed streams' minimums, "
            f"{sum(mins)} bytes ({each}): the streams share the budget, and below it chunks "
            f"would be downloaded twice an epoch. Raise it to at least {sum(mins)}, or read "
            "with fewer workers or a smaller shuffle_window"
        )

    # -- resume ------------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return self.url

    def identity(self) -> dict[str, Any]:
        out = {
            "mix": self.mode,
            "seed": self.seed,
            "mix_batch": self.mix_batch if self.unit > 1 else None,
            "epoch_size": self.epoch_size,
            "drop_last": self.drop_last,
            "streams": [
                {**st.identity(), **dataclasses.asdict(sh)}
                for st, sh in zip(self.streams, self.shares, strict=True)
            ],
        }
        if self.schedule is not None:  # (an unscheduled mix's states keep their keys)
            out["schedule"] = self.schedule.identity
        return out

    def set_epoch(self, epoch: int) -> None:
        self._pinned = None  # the epoch starts afresh, split as this configuration splits it
        super().set_epoch(epoch)

    def state_for_step(
        self, step: int, num_workers: int | None = None, batch_size: int | None = None
    ) -> dict[str, Any]:
        """As :meth:`EpochDataset.state_for_step`; a step is one batch of the consumer
        (of ``batch_size`` samples in ``random`` mode, one slot otherwise)."""
        return super().state_for_step(step, num_workers, 1 if self.unit > 1 else batch_size)

    def _state_extra(self, pr: Progress, fresh: bool) -> dict[str, Any]:
        """A scheduled mix's state names the layout its epoch is dealt by (``layout``:
        data-parallel size, DataLoader workers, positions per step, the consumer's
        ``drop_last``) and, for a callable schedule, its weights over that epoch
        (``schedule_digest``)."""
        if self.schedule is None:
            return {}
        if fresh:
            layout = self.step_layout(pr.batch_size, pr.num_workers)
        else:
            layout = self._layout_of(pr.epoch)
        out: dict[str, Any] = {
            "layout": [layout.world, layout.workers, layout.batch, layout.drop_short]
        }
        if self.schedule.fn is not None:
            out["schedule_digest"] = self._digest(pr.epoch, layout)
        return out

    def _digest(self, epoch: int, layout: Layout) -> str:
        """The callable schedule's weights over epoch ``epoch`` split by ``layout``, named
        (worked out once per epoch: a state is taken after every batch)."""
        cached = self.__dict__.get("_digest_cache")
        if cached is not None and cached[0] == (epoch, layout):
            return str(cached[1])
        steps = layout.steps(self.epoch_total)
        assert self.schedule is not None
        try:
            got = self.schedule.digest(epoch, epoch * steps, steps)
        except ValueError as exc:
            raise ConfigError(f"{self._name}: {exc}") from exc
        self.__dict__["_digest_cache"] = ((epoch, layout), got)
        return got

    def _load_extra(self, state: dict[str, Any], pr: Progress) -> None:
        if self.schedule is None:
            self._pinned = None
            return
        raw = check_mix_layout(state.get("layout"), self._name)
        layout = Layout(raw[0], raw[2], self.drop_last, raw[3], raw[1])
        if self.schedule.fn is not None:
            got = self._digest(pr.epoch, layout)
            if state.get("schedule_digest") != got:
                raise ResumeStateError(
                    f"{self._name}: the state was saved with other schedule weights in epoch "
                    f"{pr.epoch} (schedule digest {state.get('schedule_digest')!r}, this mix's "
                    f"callable schedule gives {got!r}); it can't continue that epoch"
                )
        # A fresh epoch is split as this configuration splits it; a started one keeps
        # the layout its slots were dealt by (its remaining positions name those slots).
        started = pr.received > 0 or pr.remaining is not None
        self._pinned = [pr.epoch, *raw] if started else None
        self.__dict__.pop("_mix_cache", None)

    def _published(self) -> Any:
        return self._pinned

    def _synced(self, extra: Any) -> None:
        self._pinned = extra

    def state_dict(
        self,
        received: int | None = None,
        num_workers: int | None = None,
        batch_size: int | None = None,
    ) -> dict[str, Any]:
        """As :meth:`StreamingDataset.state_dict`; ``received`` counts samples."""
        if received is None and get_worker_info() is None:
            self._own()
            if self.shared_epoch.iterated_elsewhere():
                return super().state_dict()  # raises: workers iterated it
            received, num_workers, batch_size = self._yielded, 1, self.unit
        if received is not None:
            received //= self.unit
        if self.unit > 1:
            batch_size = 1
        return super().state_dict(received, num_workers, batch_size)

    def _worker_state(self) -> dict[str, Any]:
        state = super()._worker_state()
        state["yielded"] = self._skip + self._yielded // self.unit
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As :meth:`StreamingDataset.load_state_dict`.

        Raises:
            ResumeStateError: the state is from another mix: other streams, shares, mode,
                seed, ``epoch_size``, or a stream read with another ``subsample``,
                ``epoch_size``, seed or shuffle (the message names it).
        """
        if isinstance(state, dict) and state.get("version") is not None:
            theirs = state.get("schedule")
            mine = None if self.schedule is None else self.schedule.identity
            if theirs != mine:
                raise ResumeStateError(
                    f"{self._name}: the state was saved with schedule={theirs!r}, this mix has "
                    f"schedule={mine!r}; it can't continue that epoch"
                )
        if isinstance(state, dict) and isinstance(state.get("streams"), list):
            mine = self.identity()["streams"]
            theirs = state["streams"]
            if len(theirs) != len(mine):
                raise ResumeStateError(
                    f"{self._name}: the state is of a mix of {len(theirs)} streams, "
                    f"this one has {len(mine)}"
                )
            for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
                if not isinstance(a, dict):
                    raise ResumeStateError(f"{self._name}: stream {i} of the state is not a dict")
                for key in sorted(set(a) | set(b)):
                    if a.get(key) != b.get(key):
                        raise ResumeStateError(
                            f"{self._name}: stream {i} of the state was read with "
                            f"{key}={a.get(key)!r}, this mix has {key}={b.get(key)!r}; it "
                            "can't continue that epoch"
                        )
        super().load_state_dict(state)

    def close(self) -> None:
        for s in self.streams:
            s.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_mix_cache", "_stream_orders", "_window", "_project_memo", "_digest_cache"):
            state.pop(key, None)
        return state

    def __repr__(self) -> str:
        return (
            f"MixedDataset({len(self.streams)} streams, mode={self.mode!r}, "
            f"counts={self.stream_counts}, epoch={self.epoch})"
        )
