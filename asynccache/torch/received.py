"""One epoch's batches as a loader's consumer receives them, counted for its state."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .workers import close_iterator

__all__ = ["EpochBatches", "EpochIterator"]


class EpochBatches:
    """One epoch's count of the batches its consumer received.

    Invariants:

    * ``received`` is the only count the loader's state reports. It counts the batches
      returned from the epoch's iterator (plus ``received`` at the start, for a resumed
      epoch).
    * After ``close()`` nothing is counted any more: a batch that a producer thread
      stuck inside the source returns later is dropped, not handed out, not counted.
      The check and the count happen under one lock, so ``close()`` either precedes a
      batch (not counted) or follows it (counted, and the caller got it).
    * ``map_order``: the epoch runs in the writing epoch's order (the writing epoch, or
      its rest read back from the filled cache); else in the streamed order.
    * ``ended``: the epoch's last batch was handed out (its iterator is exhausted).
    * The loader keeps this count; only the consumer keeps the :class:`EpochIterator`
      (this holds it weakly). An iterator the consumer drops (``break`` out of a loop)
      is freed at once with the source's generator, which stops its workers then; the
      loader's state still reports what was received. (Held strongly, the iterator and
      the generator, whose frame holds the loader, would wait for the garbage collector,
      which may run first in a forked worker of the next epoch.)
    """

    def __init__(self, epoch: int, map_order: bool, received: int) -> None:
        self.epoch, self.map_order, self.received = epoch, map_order, received
        self._iterator: weakref.ref[EpochIterator] | None = None
        # Reentrant: a Fetcher collected by the garbage collector closes its epoch from
        # whatever thread the collection runs on, possibly one inside next() here.
        self._lock = threading.RLock()
        self._closed = False
        self._running = False  # a thread is inside next() of the source
        self.ended = False

    def run(self, inner: Iterator[Any]) -> EpochIterator:
        """The consumer's iterator over ``inner``, counted here."""
        it = EpochIterator(self, inner)
        self._iterator = weakref.ref(it)
        return it

    def restart(self, epoch: int, map_order: bool) -> None:
        """The batches that follow belong to ``epoch``, from its start."""
        with self._lock:
            self.epoch, self.map_order, self.received = epoch, map_order, 0

    def close(self) -> None:
        """Stop the epoch: no batch is handed out or counted after this returns."""
        with self._lock:
            self._closed = True
            running = self._running
        it = None if self._iterator is None else self._iterator()
        if it is not None and not running:  # else the thread inside closes it on its way out
            it.close_inner()

    def next_of(self, inner: Iterator[Any]) -> Any:
        """The next batch of ``inner``, counted (StopIteration once closed)."""
        with self._lock:
            if self._closed:
                raise StopIteration
            self._running = True
        try:
            batch = next(inner)
        except BaseException as exc:
            with self._lock:
                self._running = False
                self.ended = self.ended or isinstance(exc, StopIteration)
            raise
        with self._lock:
            self._running = False
            closed = self._closed
            if not closed:
                self.received += 1
        if closed:
            close_iterator(inner)
            raise StopIteration
        return batch


class EpochIterator:
    """What ``iter(loader)`` returns: the epoch's batches, each counted by its
    :class:`EpochBatches`."""

    close_is_thread_safe = True  # the Fetcher may close it while its thread is inside

    def __init__(self, count: EpochBatches, inner: Iterator[Any]) -> None:
        self.count, self._inner = count, inner

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        return self.count.next_of(self._inner)

    def close(self) -> None:
        """Stop the epoch (see :meth:`EpochBatches.close`)."""
        self.count.close()

    def close_inner(self) -> None:
        close_iterator(self._inner)
