"""Starting and stopping an epoch's DataLoader workers.

* :func:`lazy`: the workers start at the first batch asked for (not at ``iter()``), and
  end with the epoch when it ends by an error or is closed;
* :func:`led`: the first batches are built in the main process (:mod:`.lead`) and handed
  over while the workers start: forked by the thread asking for the first batch before it
  returns, or started by a thread (spawn, forkserver), bounded by
  ``ASYNCCACHE_WORKER_START_S``;
* :func:`shut_down`: end the workers of an iterator nobody reads.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling

from ..errors import WorkerStartError
from .lead import FirstBatches

__all__ = ["lazy", "led", "shut_down"]

# The most the batches built in the main process delay the start of the workers. On
# loopback they are built in about 0.1 s and the workers fork after them (a fork holds
# the interpreter lock); on a far link building them is mostly waiting for range reads,
# during which the workers' own chunk GETs are better under way (docs/streaming.md, "The
# workers' start"). Where the main process has measured the link as far, the workers
# start at once.
_START_AFTER_S = 0.15
_START_POLL_S = 0.01  # how often the wait looks at the link's estimate


def shut_down(it: Iterator[Any]) -> None:
    """End the worker processes of a DataLoader iterator nobody reads."""
    shutdown = getattr(it, "_shutdown_workers", None)  # (torch has no public way)
    if callable(shutdown):
        shutdown()


@contextlib.contextmanager
def _ended(loader: Any, it: Iterator[Any]) -> Iterator[None]:
    """Shut down the workers of ``it`` (an iterator of ``loader``) when the epoch ends by
    an error or is closed, not when the iterator is collected.

    An error's traceback holds the iterator (torch's frames have it as ``self``), and a
    caller keeping the error (a test, a log) keeps it in a reference cycle. The cycle
    collector then clears the weak references of its queues before it calls its
    ``__del__``: their feeder threads are gone, the end-of-work signal never reaches the
    workers, and torch waits 5 s for each before killing it. Shut down here, they get
    it at once. (A persistent loader keeps its workers for the next epoch.)"""
    try:
        yield
    except BaseException:
        if not getattr(loader, "persistent_workers", False):
            shut_down(it)
        raise


def close_iterator(it: Iterator[Any]) -> None:
    """Close ``it`` where it can be closed (a generator: its ``finally`` runs now)."""
    close = getattr(it, "close", None)
    if callable(close):
        close()


def led_or_lazy(
    first_batches: Callable[[], FirstBatches | None], loader: DataLoader[Any]
) -> Iterator[Any]:
    """At the first batch asked for (not before: a loader iterated but never read builds
    nothing): ``first_batches()``'s batches built here while the workers start
    (:func:`led`), or, where the dataset builds none here (None), the workers' batches
    as usual (:func:`lazy`)."""
    first = first_batches()
    if first is None:
        yield from lazy(loader)
    else:
        yield from led(first, loader)


def lazy(loader: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``loader`` only when the first batch is asked for (DataLoader workers
    start then, not at ``iter()``); its workers end with the epoch (see :func:`_ended`)."""
    it = iter(loader)
    with _ended(loader, it):
        yield from it


def forks(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``'s workers start by ``fork`` (its context, else the default)."""
    ctx = loader.multiprocessing_context
    if ctx is not None:
        return bool(ctx.get_start_method() == "fork")
    # (unset: the first of these is the default, and torch's workers will fix it)
    method = multiprocessing.get_start_method(allow_none=True)
    return (method or multiprocessing.get_all_start_methods()[0]) == "fork"


def led(first: FirstBatches, loader: DataLoader[Any]) -> Iterator[Any]:
    """:func:`led_forking` where the workers fork, else :func:`led_starting`."""
    if forks(loader):
        return led_forking(first, loader)
    return led_starting(first, loader)


def led_forking(first: FirstBatches, loader: DataLoader[Any]) -> Iterator[Any]:
    """At the first batch asked for: build ``first``'s batches here, fork the workers,
    hand the batches over, then the workers' batches, which begin after them.

    Forked by the thread asking for the first batch, before it has it: a child forked by
    another thread while the consumer runs its step would inherit whatever lock the step
    held at that moment (torch's, or the consumer's own) and wait for it forever; so
    would a child forked while a :class:`~asynccache.torch.Fetcher`'s step runs beside
    the thread that iterates (its step waits for that first batch). Where the link is
    known to be far, the workers fork before the batches are built, so that their chunk
    GETs are under way meanwhile; so do they where the batches are a long copy of cached
    chunks (32 MiB or more: the workers' own first batches follow sooner). The order of
    batches and the states taken between them are those of an epoch whose workers made
    every batch."""
    it: Iterator[Any] | None = None
    try:
        if first.workers_first():
            it = iter(loader)  # forks the workers
        ready = first.build_all()
        if it is None:
            first.before_fork()
            it = iter(loader)  # forks the workers
        while ready:
            yield ready.pop(0)  # (the consumer's now)
        with _ended(loader, it):
            yield from it
    finally:
        # First: a worker waiting for a chunk the main process started for it (its
        # download lock) would hold its own shutdown up until torch kills it.
        first.stop_head()
        if it is not None and not getattr(loader, "persistent_workers", False):
            shut_down(it)  # (none left at the epoch's end; an epoch left early: its workers)
        first.done()


def led_starting(first: FirstBatches, loader: DataLoader[Any]) -> Iterator[Any]:
    """At the first batch asked for: build ``first``'s batches here, hand them over while
    a thread starts the workers (spawn, forkserver: a fresh interpreter or the fork
    server's child, which inherits no lock of this process), then the workers' batches,
    which begin after them.

    The order of batches and the states taken between them are those of an epoch whose
    workers made every batch. Starting the workers is bounded
    (``first.worker_start_s``: :class:`WorkerStartError`); workers that start after the
    bound, or that nobody will read (the consumer left before their first batch), are
    shut down at once."""
    bound = first.worker_start_s
    if threading.current_thread() is threading.main_thread():
        # torch installs its handler reporting a dead worker only from the main thread
        # (and only privately).
        signal_handling._set_SIGCHLD_handler()
    started: list[Iterator[Any]] = []
    failed: list[BaseException] = []
    go = threading.Event()  # set: the batches are built (or building them failed)
    late = threading.Event()  # set: the workers' start ran past its bound
    built: list[bool] = []
    mu = threading.Lock()  # hands a started iterator over, or leaves it to be shut down

    def start() -> None:
        # Forking holds the interpreter lock: wait until the batches are built, so they
        # are handed over at once; batches that take long (a slow link) get the workers'
        # start beside them after _START_AFTER_S, or at once on a link known to be far.
        until = time.monotonic() + _START_AFTER_S
        while not go.is_set() and not first.far_link():
            left = until - time.monotonic()
            if left <= 0:
                break
            go.wait(min(left, _START_POLL_S))
        if go.is_set() and not built:
            return  # building them failed: nothing to start
        try:
            it = iter(loader)  # forks (or spawns) the workers
        except BaseException as exc:  # raised to the consumer at the next batch
            failed.append(exc)
            return
        with mu:
            orphan = late.is_set()  # the consumer gave up waiting: nobody will read them
            if not orphan:
                started.append(it)
        if orphan:
            shut_down(it)

    starter = threading.Thread(target=start, name="asynccache-workers", daemon=True)
    starter.start()
    try:
        # All built before the first is handed over: the forks then hold the interpreter
        # lock while the consumer has the first batch, and the second is ready at once.
        ready = first.build_all()
        built.append(True)
        go.set()  # the workers start while the consumer has the first batch
        while ready:
            yield ready.pop(0)  # (the consumer's now)
        _join_started(starter, loader, late, bound)
        if failed:
            raise failed[0]
        with _ended(loader, started[0]):
            yield from started[0]
    finally:
        go.set()
        # First: a worker waiting for a chunk the main process started for it (its
        # download lock) would hold its own shutdown up until torch kills it.
        first.stop_head()
        # Not again for the whole bound when it has passed once (the error is waiting):
        # workers that start later find `late` set and shut themselves down.
        starter.join(0 if late.is_set() else bound)
        with mu:
            gave_up = late.is_set()
            late.set()
            left, started[:] = list(started), []
        for it in left:  # never read to their end: not the epoch's workers any more
            if gave_up or not getattr(loader, "persistent_workers", False):
                shut_down(it)
                if getattr(loader, "_iterator", None) is it:
                    # A persistent loader starts anew (torch keeps its iterator privately).
                    loader._iterator = None
        first.done()


def _join_started(
    starter: threading.Thread, loader: DataLoader[Any], late: threading.Event, bound: float
) -> None:
    """Wait for ``starter`` to have started ``loader``'s workers, at most ``bound``
    seconds; past it, raise :class:`WorkerStartError` (workers it starts later are shut
    down at once)."""
    starter.join(bound)
    if not starter.is_alive():
        return
    late.set()
    ctx = loader.multiprocessing_context
    method = ctx.get_start_method() if ctx is not None else "the default start method"
    raise WorkerStartError(
        f"the DataLoader's {loader.num_workers} worker processes ({method}) did not start "
        f"within {bound:g} s (ASYNCCACHE_WORKER_START_S); the batches built in the main "
        "process were handed out, the rest of the epoch has no workers to come from"
    )
