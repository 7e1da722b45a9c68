"""One epoch's batches as a loader's consumer receives them, counted for its state."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["EpochBatches"]


class EpochBatches:
    """One epoch's batches as the consumer receives them, and how many it received.

    Invariants:

    * ``received`` is the only count the loader's state reports. It counts the batches
      returned from ``__next__`` (plus ``received`` at the start, for a resumed epoch).
    * After ``close()`` nothing is counted any more: a batch that a producer thread
      stuck inside the source returns later is dropped, not handed out, not counted.
      The check and the count happen under one lock, so ``close()`` either precedes a
      batch (not counted) or follows it (counted, and the caller got it).
    * ``map_order``: the epoch runs in the writing epoch's order (the writing epoch, or
      its rest read back from the filled cache); else in the streamed order.
    * ``ended``: the epoch's last batch was handed out (its iterator is exhausted).
    """

    close_is_thread_safe = True  # the Fetcher may close it while its thread is inside

    def __init__(self, epoch: int, map_order: bool, received: int) -> None:
        self.epoch, self.map_order, self.received = epoch, map_order, received
        self._inner: Iterator[Any] = iter(())
        # Reentrant: a Fetcher collected by the garbage collector closes its epoch from
        # whatever thread the collection runs on, possibly one inside __next__ here.
        self._lock = threading.RLock()
        self._closed = False
        self._running = False  # a thread is inside next(self._inner)
        self.ended = False

    def run(self, inner: Iterator[Any]) -> EpochBatches:
        self._inner = inner
        return self

    def restart(self, epoch: int, map_order: bool) -> None:
        """The batches that follow belong to ``epoch``, from its start."""
        with self._lock:
            self.epoch, self.map_order, self.received = epoch, map_order, 0

    def __iter__(self) -> EpochBatches:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._closed:
                raise StopIteration
            self._running = True
        try:
            batch = next(self._inner)
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
            self._close_inner()
            raise StopIteration
        return batch

    def close(self) -> None:
        """Stop the epoch: no batch is handed out or counted after this returns."""
        with self._lock:
            self._closed = True
            running = self._running
        if not running:  # else the thread inside it closes it when it comes out
            self._close_inner()

    def _close_inner(self) -> None:
        close = getattr(self._inner, "close", None)
        if callable(close):
            close()
