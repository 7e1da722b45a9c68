"""The Fetcher: the training step computes while the next batches load and copy.

``Fetcher`` wraps any iterable of batches (typically a ``CacheDataLoader``). A
background thread pulls batches ahead of the training step, starts their copy to
the device, and records the source's resume state after each one. The step sees
the batches in order, knows when the batch it holds is the last one (``done``),
and can checkpoint a state that never runs ahead of what it has consumed.

See ``docs/fetcher.md`` for examples.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from asynccache.errors import ConfigError, ResumeStateError
from asynccache.torch._device import DeviceTransfer, InFlight, make_transfer

__all__ = ["Fetcher", "FetcherStats"]

_log = logging.getLogger("asynccache.fetcher")

T = TypeVar("T")

_POLL_S = 0.05  # longest single wait on a condition; every wait loops on a stop check
_THREAD_NAME = "asynccache-fetcher"


class _End:
    """The source is exhausted."""


_END = _End()


@dataclass(frozen=True)
class _Failed:
    """The source (or the copy) raised ``error``; it is re-raised in the consumer."""

    error: BaseException


@dataclass(frozen=True)
class _Item:
    """One produced batch and the source's state right after producing it."""

    inflight: InFlight
    state: Any


_Head = _Item | _Failed | _End
_Snapshot = Callable[[], Any]


def _snapshot_of(source: Any) -> _Snapshot | None:
    """Returns a function copying the source's state, or None for a stateless source."""
    state_dict = getattr(source, "state_dict", None)
    if not callable(state_dict):
        return None
    # A deep copy: a source may hand out its live state and keep mutating it.
    return lambda: copy.deepcopy(state_dict())


def _produce_one(
    iterator: Iterator[Any], transfer: DeviceTransfer, snapshot: _Snapshot | None
) -> _Head:
    """Pulls one batch and starts its copy; never raises."""
    try:
        batch = next(iterator)
    except StopIteration:
        return _END
    except BaseException as exc:  # relay everything, so the consumer never waits forever
        return _Failed(exc)
    try:
        state = snapshot() if snapshot is not None else None
        return _Item(transfer.send(batch), state)
    except BaseException as exc:
        return _Failed(exc)


def _close_iterator(iterator: Iterator[Any], *, producer_alive: bool) -> None:
    """Tells the source's iterator that nobody takes its batches any more.

    A stateful source (``CacheDataLoader``) stops counting there, so a batch that a
    producer thread stuck in the source returns after ``close()`` never advances the
    source's state. While the producer thread may still be inside the iterator, only an
    iterator that declares ``close_is_thread_safe`` is closed: closing a generator that
    another thread is running is not safe in CPython (it can corrupt the generator's
    state, not just raise ``ValueError``). Any other iterator is closed once the thread
    has left it, or when it is collected.
    """
    close = getattr(iterator, "close", None)
    if not callable(close):
        return
    if producer_alive and not getattr(iterator, "close_is_thread_safe", False):
        return
    try:
        close()
    except ValueError:  # "generator already executing": in the producer thread
        pass
    except Exception:  # the source's own clean-up failed: the epoch is over anyway
        _log.warning("closing the source's iterator failed", exc_info=True)


class _Channel:
    """A bounded FIFO from one producer to one consumer that the consumer can peek at.

    Holds at most ``capacity`` items, plus one terminal marker (end or failure)
    that takes no slot. A slot is freed only when the consumer pops an item, so an
    item being peeked at for the look-ahead still counts against the capacity.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: collections.deque[_Item] = collections.deque()
        self._terminal: _Failed | _End | None = None
        self._closed = False
        self._cond = threading.Condition()

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: _Item) -> bool:
        """Appends ``item`` once a slot is free; returns False if closed meanwhile."""
        with self._cond:
            while len(self._items) >= self._capacity and not self._closed:
                self._cond.wait(_POLL_S)
            if self._closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def finish(self, terminal: _Failed | _End) -> None:
        with self._cond:
            self._terminal = terminal
            self._cond.notify_all()

    def peek(self, producer: threading.Thread) -> _Head:
        """Waits for the oldest item (or the terminal marker) and returns it in place."""
        with self._cond:
            while not self._items and self._terminal is None:
                if not producer.is_alive():  # cannot happen unless the interpreter is exiting
                    return _Failed(RuntimeError("the fetcher's producer thread died"))
                self._cond.wait(_POLL_S)
            return self._items[0] if self._items else self._terminal  # type: ignore[return-value]

    def pop(self) -> None:
        with self._cond:
            self._items.popleft()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()


def _run_producer(
    iterator: Iterator[Any],
    channel: _Channel,
    transfer: DeviceTransfer,
    snapshot: _Snapshot | None,
) -> None:
    """The producer thread's body. It holds no reference to the Fetcher itself.

    Like ``DataLoader``'s pin-memory thread, it first limits its own intra-op
    parallelism to one thread (``torch.set_num_threads`` is per thread with the
    OpenMP backend: the caller's setting is untouched) and, for CUDA, makes the
    target its current device.
    """
    try:
        torch.set_num_threads(1)
        transfer.enter_thread()
    except BaseException as exc:
        channel.finish(_Failed(exc))
        return
    while not channel.closed:
        head = _produce_one(iterator, transfer, snapshot)
        if not isinstance(head, _Item):
            channel.finish(head)
            return
        if not channel.put(head):
            return


class _ThreadFeed:
    """Batches produced by a background thread into a :class:`_Channel`."""

    def __init__(
        self,
        iterator: Iterator[Any],
        transfer: DeviceTransfer,
        snapshot: _Snapshot | None,
        capacity: int,
    ) -> None:
        self._channel = _Channel(capacity)
        self._iterator = iterator
        self._thread = threading.Thread(
            target=_run_producer,
            args=(iterator, self._channel, transfer, snapshot),
            name=_THREAD_NAME,
            daemon=True,
        )
        self._thread.start()

    def peek(self) -> _Head:
        return self._channel.peek(self._thread)

    def pop(self) -> None:
        self._channel.pop()

    def close(self, timeout_s: float) -> None:
        self._channel.close()
        # Before the join: a stuck producer commits nothing (thread-safe closes only).
        _close_iterator(self._iterator, producer_alive=True)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            _close_iterator(self._iterator, producer_alive=False)  # the thread left it
        else:
            _log.warning(
                "the fetcher's producer is still inside the source after %.1f s; "
                "it exits as soon as the source returns",
                timeout_s,
            )


class _SyncFeed:
    """Batches produced on demand by the consumer itself (``prefetch_batches=0``)."""

    def __init__(
        self, iterator: Iterator[Any], transfer: DeviceTransfer, snapshot: _Snapshot | None
    ) -> None:
        self._iterator: Iterator[Any] | None = iterator
        self._transfer = transfer
        self._snapshot = snapshot
        self._head: _Head | None = None

    def peek(self) -> _Head:
        if self._head is None:
            if self._iterator is None:
                return _END
            self._head = _produce_one(self._iterator, self._transfer, self._snapshot)
        return self._head

    def pop(self) -> None:
        self._head = None

    def close(self, timeout_s: float) -> None:
        if self._iterator is not None:
            _close_iterator(self._iterator, producer_alive=False)
        self._iterator = None
        self._head = None


@dataclass(frozen=True)
class FetcherStats:
    """How long the consumer waited for data in the current (or last) epoch.

    Attributes:
        steps: Batches handed to the consumer.
        wait_s: Total time the consumer blocked in ``__next__`` waiting for data.
        wall_s: Time from the epoch's first ``__next__`` call to the end of its
            latest one (the call that ends the epoch included).
        stall_pct: ``100 * wait_s / wall_s``: the share of wall time spent waiting.
        last_wait_s: How long the latest ``__next__`` waited.
    """

    steps: int = 0
    wait_s: float = 0.0
    wall_s: float = 0.0
    stall_pct: float = 0.0
    last_wait_s: float = 0.0

    def __repr__(self) -> str:
        return (
            f"FetcherStats(steps={self.steps}, wait_s={self.wait_s:.3f}, "
            f"wall_s={self.wall_s:.3f}, stall_pct={self.stall_pct:.1f}, "
            f"last_wait_s={self.last_wait_s:.4f})"
        )


class Fetcher(Generic[T]):
    """Iterates over ``iterable`` while a background thread loads the next batches.

    Back-pressure invariant: at most ``prefetch_batches`` batches are produced but
    not yet handed to the consumer, plus one being produced by the background
    thread. The look-ahead that tells ``done`` is one of those ``prefetch_batches``.
    With ``prefetch_batches=0`` there is no thread: the consumer pulls one batch
    ahead itself, on demand, which is the least that knowing ``done`` costs.

    Other invariants:

    * ``done`` is true exactly when the batch just returned is the last of the
      epoch, for sized and unsized sources alike.
    * ``state_dict()`` is the source's state as of the last batch returned to the
      consumer, never ahead of it, although the thread has pulled further.
    * An exception raised by the source is raised from ``__next__`` with its
      original traceback, after the batches produced before it.
    * Each ``iter()`` starts a fresh epoch (``iter()`` on the source again) and
      stops the previous epoch's thread; ``close()`` stops it mid-epoch. No thread
      outlives its epoch, and every wait is bounded.
    * Stopping an epoch calls ``close()`` on the source's iterator (when it has one),
      before waiting for the thread: a batch the thread is still producing is then
      never counted by a source that counts what its iterator hands out.

    Args:
        iterable: The source of batches. If it has ``state_dict``/``load_state_dict``
            (a stateful data loader), the fetcher forwards them.
        prefetch_batches: How many batches to hold ready ahead of the consumer.
        device: Copy each batch to this device. ``None`` or a CPU device leaves
            batches untouched. ``"cuda"`` means the current CUDA device when an epoch
            starts (``iter()``). CUDA copies run on the background thread; other
            accelerators are copied on the consumer thread. See ``docs/fetcher.md``
            for the contract with a source that hands out pinned memory.
        pin_memory: Pin host tensors before a CUDA copy; ``None`` means yes for CUDA.
            Ignored, with a warning, for other devices.
        non_blocking: Copy to CUDA asynchronously, on a side stream.
        transform: Applied to each batch on the consumer thread, after the device
            copy, just before it is returned.
        yield_iterator: Iterating yields the fetcher itself once per step, for steps
            that pull their own batches with ``next()``; see ``docs/fetcher.md``.
        log_every: Log the wait statistics to the ``asynccache.fetcher`` logger every
            this many batches; 0 disables it.
        close_timeout_s: How long ``close()`` waits for the thread to stop.

    Raises:
        ConfigError: An argument is out of range, or CUDA is asked for but absent.
    """

    def __init__(
        self,
        iterable: Iterable[T],
        prefetch_batches: int = 2,
        device: torch.device | str | None = None,
        pin_memory: bool | None = None,
        non_blocking: bool = True,
        transform: Callable[[Any], Any] | None = None,
        *,
        yield_iterator: bool = False,
        log_every: int = 0,
        close_timeout_s: float = 5.0,
    ) -> None:
        if prefetch_batches < 0:
            raise ConfigError(f"prefetch_batches must be >= 0, got {prefetch_batches}")
        if log_every < 0:
            raise ConfigError(f"log_every must be >= 0, got {log_every}")
        if close_timeout_s <= 0:
            raise ConfigError(f"close_timeout_s must be > 0, got {close_timeout_s}")
        self._source = iterable
        self.prefetch_batches = prefetch_batches
        self._transfer = make_transfer(device, pin_memory=pin_memory, non_blocking=non_blocking)
        self._epoch_transfer = self._transfer  # bound to a device index by each iter()
        self._transform = transform
        self._yield_iterator = yield_iterator
        self._log_every = log_every
        self._close_timeout_s = close_timeout_s
        self._snapshot = _snapshot_of(iterable)
        self._feed: _ThreadFeed | _SyncFeed | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._state: Any = None
        self._has_state = False  # False: no epoch since construction or load_state_dict
        self.done = False
        """True when the batch just returned is the last one of the epoch."""
        self.fetched = 0
        """Batches handed to the consumer in this epoch."""
        self._wait_s = 0.0
        self._last_wait_s = 0.0
        self._first_call: float | None = None
        self._last_call_end: float | None = None
        self._clock_stopped = False

    # -- iteration -------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._start_epoch()
        return self._steps() if self._yield_iterator else self

    def __next__(self) -> Any:
        start = time.perf_counter()
        if self._first_call is None:
            self._first_call = start
        feed = self._feed
        if feed is None:
            self._stop_clock()
            raise StopIteration
        head = feed.peek()
        if not isinstance(head, _Item):
            self._stop_epoch()
            self._stop_clock()
            if isinstance(head, _Failed):
                raise head.error  # the source's own traceback comes along
            raise StopIteration
        feed.pop()
        self.done = isinstance(feed.peek(), _End)
        waited = time.perf_counter() - start
        if self.done:
            self._stop_epoch()  # the thread has finished; join it now
        batch = self._epoch_transfer.receive(head.inflight)
        self._state = head.state
        self.fetched += 1
        self._record_wait(waited)
        if self._transform is not None:
            batch = self._transform(batch)
        self._last_call_end = time.perf_counter()
        return batch

    def _steps(self) -> Iterator[Fetcher[T]]:
        """Yields the fetcher once per step while a batch remains (``yield_iterator``)."""
        while self._feed is not None and not isinstance(self._feed.peek(), _End):
            yield self
        self._stop_epoch()

    def __len__(self) -> int:
        if not isinstance(self._source, Sized):
            raise TypeError(f"{type(self._source).__name__} has no len(), so neither has Fetcher")
        return len(self._source)

    # -- life cycle ------------------------------------------------------------

    def _start_epoch(self) -> None:
        self._stop_epoch()
        self.done = False
        self.fetched = 0
        self._reset_stats()
        # "cuda" without an index means the caller's current device now, not at construction.
        transfer = self._epoch_transfer = self._transfer.bind()
        iterator = iter(self._source)
        self._state = self._snapshot() if self._snapshot is not None else None
        self._has_state = True
        feed: _ThreadFeed | _SyncFeed
        if self.prefetch_batches == 0:
            feed = _SyncFeed(iterator, transfer, self._snapshot)
        else:
            feed = _ThreadFeed(iterator, transfer, self._snapshot, self.prefetch_batches)
        self._feed = feed
        # Stops the thread if the fetcher is dropped mid-epoch, or at interpreter exit.
        self._finalizer = weakref.finalize(self, feed.close, self._close_timeout_s)

    def _stop_epoch(self) -> None:
        feed, self._feed = self._feed, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if feed is not None:
            feed.close(self._close_timeout_s)

    def close(self) -> None:
        """Stops the background thread, even mid-epoch. Idempotent; ``iter()`` restarts."""
        self._stop_epoch()
        self._stop_clock()

    def __enter__(self) -> Fetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- resume state ----------------------------------------------------------

    def state_dict(self) -> Any:
        """Returns the source's state as of the last batch handed to the consumer.

        Before any epoch (or right after ``load_state_dict``) this is the source's
        own ``state_dict()``. A source without ``state_dict`` gives ``{}``.
        """
        if self._snapshot is None:
            return {}
        if not self._has_state:
            return self._snapshot()
        return copy.deepcopy(self._state)

    def load_state_dict(self, state_dict: Any) -> None:
        """Stops the current epoch and loads ``state_dict`` into the source.

        The next ``iter()`` resumes right after the batch the state was taken at.

        Raises:
            ResumeStateError: The state is not empty and the source cannot load it.
        """
        self._stop_epoch()
        load = getattr(self._source, "load_state_dict", None)
        if callable(load):
            load(state_dict)
        elif state_dict:
            raise ResumeStateError(f"{type(self._source).__name__} has no load_state_dict()")
        self.done = False
        self.fetched = 0
        self._state = None
        self._has_state = False

    # -- statistics ------------------------------------------------------------

    def _reset_stats(self) -> None:
        self._wait_s = 0.0
        self._last_wait_s = 0.0
        self._first_call = None
        self._last_call_end = None
        self._clock_stopped = False

    def _stop_clock(self) -> None:
        if self._first_call is not None and not self._clock_stopped:
            self._last_call_end = time.perf_counter()
            self._clock_stopped = True

    def _record_wait(self, waited: float) -> None:
        self._wait_s += waited
        self._last_wait_s = waited
        if self._log_every and self.fetched % self._log_every == 0:
            _log.info("%r", self.stats)

    @property
    def stats(self) -> FetcherStats:
        """Wait statistics of the current (or last) epoch."""
        if self._first_call is None:
            return FetcherStats()
        end = self._last_call_end if self._last_call_end is not None else time.perf_counter()
        wall = max(end - self._first_call, 0.0)
        return FetcherStats(
            steps=self.fetched,
            wait_s=self._wait_s,
            wall_s=wall,
            stall_pct=100.0 * self._wait_s / wall if wall > 0 else 0.0,
            last_wait_s=self._last_wait_s,
        )

    def __repr__(self) -> str:
        device = self._epoch_transfer.device
        return (
            f"Fetcher({type(self._source).__name__}, prefetch_batches={self.prefetch_batches}, "
            f"device={device}, fetched={self.fetched}, done={self.done}, "
            f"running={self._feed is not None})"
        )
