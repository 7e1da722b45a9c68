"""Which input each pool worker's ``fn`` is on, and since when: the per-input timeout's clock.

The driver gives its pool one shared array of doubles, two per worker: the input number
(``-1``: between inputs, or waiting on storage, which is not ``fn``'s time) and the
``time.monotonic()`` at which ``fn`` started on it (``CLOCK_MONOTONIC`` is one clock for
every process of a host). A worker writes only its own slot, the driver only reads:

* writer order: number ``-1``, then the start, then the number;
* reader order: number, start, number again; the pair is trusted only when both numbers
  agree. A worker never starts the same input twice in a row; it only takes an input up
  again after a storage wait, and then either start it wrote is a right one.

No lock: a worker killed mid-write leaves nothing held. Layer: stdlib only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

IDLE = -1.0


class InputClock:
    """A worker's writer of slot ``slot`` of ``slots`` (a shared ``RawArray("d")``)."""

    def __init__(self, slots: Any, slot: int) -> None:
        self.slots, self.at = slots, 2 * slot

    def begin(self, number: int) -> None:
        """``fn`` starts on input ``number`` (its number in the whole job) now."""
        a, s = self.slots, self.at
        a[s] = IDLE
        a[s + 1] = time.monotonic()
        a[s] = float(number)

    def end(self) -> None:
        self.slots[self.at] = IDLE

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A wait on storage inside an input: not counted as ``fn``'s time."""
        a, s = self.slots, self.at
        number = a[s]
        if number == IDLE:
            yield
            return
        t0 = time.monotonic()
        a[s] = IDLE
        try:
            yield
        finally:
            a[s + 1] = a[s + 1] + (time.monotonic() - t0)
            a[s] = number


class _NoClock:
    """Inline runs and engines of the per-shard API: nobody watches."""

    def begin(self, number: int) -> None:
        pass

    def end(self) -> None:
        pass

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield


NO_CLOCK = _NoClock()
_clock: InputClock | _NoClock = NO_CLOCK


def clock() -> InputClock | _NoClock:
    """This process's clock: a pool worker's slot, else one that records nothing."""
    return _clock


def claim_slot(slots: Any, counter: Any) -> None:
    """In a new pool worker: take the next free slot (``counter``: a shared ``Value("i")``)."""
    global _clock
    with counter.get_lock():
        slot = counter.value
        counter.value += 1
    if 2 * slot + 1 < len(slots):
        _clock = InputClock(slots, slot)


def overdue(slots: Any, limit_s: float, now: float | None = None) -> tuple[int, float] | None:
    """``(input number, seconds)`` of a worker whose ``fn`` has run past ``limit_s``, or None."""
    now = time.monotonic() if now is None else now
    for s in range(0, len(slots), 2):
        first = slots[s]
        start = slots[s + 1]
        if first == IDLE or slots[s] != first:
            continue
        if now - start > limit_s:
            return int(first), now - start
    return None
