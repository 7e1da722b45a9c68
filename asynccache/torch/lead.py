"""The first batches of an epoch, built in the main process while the workers start.

``CacheDataLoader`` builds up to :data:`LEAD_BATCHES` batches of an epoch in its own
process (one per DataLoader worker: each worker's first) and hands them over while the
workers fork; the workers then begin at the batch after them. The batches, their order
and the resume states taken between them are those of an epoch whose workers made every
batch (docs/streaming.md, "The first batch built in the main process").

* :func:`lead_runs` chooses which units those batches hold;
* :class:`FirstBatches` is the handle the loader drives (expect, build, stop, done);
* :class:`HeadStart` starts downloading the workers' first chunks from the main process
  on a slow link (``ASYNCCACHE_HEAD_START``; docs/tuning.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..config import Settings
from ..download.link import endpoint_of, link_for, part_bytes_for
from ..format import Index
from ..read.source import DatasetSource
from ..sampling import Plan
from ..sampling.order import ReadOrder
from ..sampling.partition import received_per_worker
from ..sampling.progress import drop

__all__ = [
    "LEAD_BATCHES",
    "FirstBatches",
    "HeadStart",
    "LeadStats",
    "lead_runs",
    "one_thread",
    "workers_first_chunks",
]

# The most batches built in the main process at an epoch's start (one per worker, each
# worker's first): the second batch is ready while the workers start; more would delay
# the first (their items come in one round of range reads). One when the first batch's
# items are read by range from a shuffled order: a second batch's item GETs would share
# the connections with the first's and make it several times later.
LEAD_BATCHES = 2


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread while a lead batch is built, as in a DataLoader worker:
    collating on torch's OpenMP pool took several times longer than on one thread on a
    busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LeadStats:
    """How many epochs had their first batches built in the main process, and how many
    batches were built there (all epochs)."""

    def __init__(self, epochs: int, batches: int) -> None:
        self.epochs, self.batches = epochs, batches

    def __repr__(self) -> str:
        return f"LeadStats(epochs={self.epochs}, batches={self.batches})"


# The main process starts the workers' first chunks only on a link where downloading them
# takes at least this long (see HeadStart.go): on loopback a worker's wait for the main
# process's publish cost more than it saved.
_HEAD_MIN_S = 1.0
_HEAD_MIN_TTFB_S = 0.01  # ... or, with no rate measured yet, where a first byte takes this


def _first_keys(order: ReadOrder, part: Sequence[Any], skip: int, bs: int) -> np.ndarray | None:
    """The units of the next batch of a worker whose part is ``part`` after ``skip``
    positions; None when it is short (that worker's last)."""
    keys: list[np.ndarray] = []
    need = bs
    for seg in drop(part, skip):
        take = min(need, len(seg))
        keys.append(order.keys(seg.start, seg.start + take))
        need -= take
        if not need:
            break
    if need:
        return None
    return np.concatenate(keys)


def lead_runs(
    p: Plan,
    order: ReadOrder,
    received: int,
    num_workers: int,
    *,
    one_if: Callable[[np.ndarray], bool],
    fetches_nothing: Callable[[list[np.ndarray]], bool],
) -> list[np.ndarray]:
    """The units of the batches the main process builds next (in the order the consumer
    receives them, each a different logical worker's next batch), after the consumer
    received ``received`` samples.

    At least one batch of the rank is left to the workers; fewer are built when a worker's
    batch is short, one alone when ``one_if`` says so of the first (its items are read by
    range from a shuffled order: scattered items, one GET each), and only batches that
    ``fetches_nothing`` says can be built without downloading a whole chunk here (the
    workers' plans download, evict and check the budget)."""
    bs = p.batch_size
    left = p.rank_samples - received
    runs: list[np.ndarray] = []
    for i in range(min(num_workers, LEAD_BATCHES, max(0, (left - 1) // bs))):
        logical = (received // bs + i) % num_workers  # batch k: logical worker k mod W
        skip = received_per_worker(p.rank_samples, num_workers, bs, received + i * bs)[logical]
        keys = _first_keys(order, p.workers[logical], skip, bs)
        if keys is None:
            break
        runs.append(keys)
        if one_if(runs[0]):
            break
    while runs and not fetches_nothing(runs):
        runs.pop()
    return runs


def workers_first_chunks(
    p: Plan, order: ReadOrder, received: int, chunks_of: Callable[[np.ndarray], np.ndarray]
) -> list[int]:
    """The chunks of each logical worker's first batch after the consumer received
    ``received`` samples, each worker's first chunk first: worker after worker, then
    their second ones."""
    nw, bs = len(p.workers), p.batch_size
    after = received_per_worker(p.rank_samples, nw, bs, received)
    per_worker: list[list[int]] = []
    for i in range(nw):
        logical = (received // bs + i) % nw  # in the order the consumer receives them
        keys: list[np.ndarray] = []
        need = bs
        for seg in drop(p.workers[logical], after[logical]):
            take = min(need, len(seg))
            keys.append(order.keys(seg.start, seg.start + take))
            need -= take
            if not need:
                break
        if keys:
            per_worker.append(list(dict.fromkeys(chunks_of(np.concatenate(keys)).tolist())))
    out: dict[int, None] = {}
    for k in range(max((len(c) for c in per_worker), default=0)):
        out.update(dict.fromkeys(c[k] for c in per_worker if k < len(c)))
    return list(out)


class HeadStart:
    """The workers' first chunks, downloaded from the main process (docs/tuning.md, "The
    workers' first chunks").

    The workers fork, open their sessions and plan for a while; meanwhile the main
    process's connections would idle once the first batches' range reads are in. A
    worker that asks for such a chunk finds its download lock held and waits for the
    published name, so each chunk is still fetched once. The downloads take their locks
    and reservations at :meth:`start`, their parts no connection until :meth:`go` (the
    first batches' range reads share the connections). Only when the whole dataset fits
    the cache budget: the main process follows no plan, and its reservations would evict
    by recency. A forked worker does not inherit them (its downloader is its own).
    """

    def __init__(self, source: DatasetSource, index: Index, settings: Settings) -> None:
        self.source, self.index, self.settings = source, index, settings
        self._held: tuple[int, Any, int, int] | None = None  # (pid, downloader, bytes, parts)

    def start(self, chunks: list[int]) -> None:
        """Ready the downloads of ``chunks`` (the workers' first, in order): as many as
        this process's connections carry at once."""
        st = self.settings
        dl = self.source.downloader()
        link = link_for(endpoint_of(dl.storage))
        part = part_bytes_for(st, link, st.max_concurrency * st.part_bytes)
        room = st.max_concurrency * part
        take: list[int] = []
        for c in chunks:
            if room <= 0 or len(take) >= max(st.prefetch_chunks, 1):
                break
            take.append(c)
            room -= int(self.index.bytes_per_chunk[c])
        if not take:
            return
        dl.hold_prefetch(st.timeout_s)
        dl.hint([self.source.spec(c) for c in take])
        sizes = [int(self.index.bytes_per_chunk[c]) for c in take]
        # The parts as the downloader will cut them (the one place the part size is chosen).
        parts = sum(-(-n // part_bytes_for(st, link, sum(sizes), n)) for n in sizes)
        self._held = (os.getpid(), dl, sum(sizes), parts)

    def go(self) -> None:
        """The first batches are built: the readied downloads may take the connections now,
        where they take at least ``_HEAD_MIN_S`` (as the link measured so far says; with no
        rate yet, where a first byte takes at least ``_HEAD_MIN_TTFB_S``); elsewhere they
        are cancelled (a worker does better fetching the chunk itself)."""
        held = self._held
        if held is None or held[0] != os.getpid():
            return
        dl, size, parts = held[1:]
        link = link_for(endpoint_of(dl.storage))
        rate, ttfb = link.bytes_per_s, link.ttfb_s
        if rate is not None:
            slow = size / (rate * min(parts, self.settings.max_concurrency)) >= _HEAD_MIN_S
        else:  # (loopback hands a range read over in one piece: no rate, a first byte)
            slow = ttfb is None or ttfb >= _HEAD_MIN_TTFB_S
        if slow:
            dl.release_prefetch()
        else:
            self.stop()

    def stop(self) -> None:
        """Cancel what :meth:`start` readied and nobody took (the epoch is over)."""
        held, self._held = self._held, None
        if held is not None and held[0] == os.getpid():
            held[1].hint([])  # (cancelled before their held parts could go out)
            held[1].release_prefetch()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_held": None}  # a process's own downloads


@dataclasses.dataclass
class FirstBatches:
    """The batches an epoch's main process builds, as the loader drives them.

    Build them all (:meth:`build_all`) before the first is handed over; call :meth:`done`
    when the epoch ends (whatever way). ``worker_start_s`` bounds the workers' start
    while these batches are handed out (``ASYNCCACHE_WORKER_START_S``).
    """

    runs: list[np.ndarray]
    worker_start_s: float
    far_link: Callable[[], bool]
    long_copy: bool  # the batches are a long copy of cached chunks (or of a local dataset's)
    expect: Callable[[], None]
    build: Callable[[np.ndarray], Any]
    before_fork: Callable[[], None]  # work forked workers inherit rather than each redo
    stop_head: Callable[[], None]
    done: Callable[[], None]

    def workers_first(self) -> bool:
        """Fork the workers before building: the batches wait on the network (a far
        link), or are a long copy of cached chunks, which the workers' own first batches
        would otherwise wait on (docs/streaming.md, *The workers' start*)."""
        return self.long_copy or self.far_link()

    def build_all(self) -> list[Any]:
        """Every batch, built now (their items' range reads in one round)."""
        self.expect()
        return [self.build(keys) for keys in self.runs]
