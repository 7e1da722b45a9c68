"""Progress clocks: how a waiter tells a slow download from a stuck one.

A download touches its clock whenever it moves: bytes arrive, an attempt starts or ends,
a phase with its own bound begins (waiting for another process's lock, a backoff sleep,
verifying). A waiter on another thread reads the clock and gives up only when nothing
moved for its stall bound, so a large chunk on a slow but live link is never cut off by
a fixed total, and a dead one is noticed one stall bound after its last sign of life.
"""

from __future__ import annotations

import time

__all__ = ["ProgressClock"]


class ProgressClock:
    """The last moment a download (or any download of a downloader) moved.

    Invariants:
        * Written on the I/O thread only; read from any thread (plain float and int
          attributes: a reader sees an old or a new value, never a torn one).
        * Every :meth:`moved` and :meth:`quiet` of a clock with a ``parent`` also
          touches the parent, so a downloader-wide clock moves with any of its downloads.
        * ``queued`` counts requests waiting for a concurrency slot: while it is above
          zero, the download moves when the downloader does (a slot frees only when
          another request finishes). ``held`` counts its requests holding a slot.
    """

    __slots__ = ("bytes", "held", "last", "parent", "queued", "quiet_until")

    def __init__(self, parent: ProgressClock | None = None) -> None:
        self.last = time.monotonic()
        self.quiet_until = 0.0
        self.bytes = 0
        self.queued = 0
        self.held = 0
        self.parent = parent

    def moved(self, nbytes: int = 0) -> None:
        """Something happened now (``nbytes`` arrived, or a phase began or ended)."""
        self.last = time.monotonic()
        self.bytes += nbytes
        if self.parent is not None:
            self.parent.moved(nbytes)

    def quiet(self, seconds: float) -> None:
        """A phase bounded by ``seconds`` of its own begins: silence until then is fine."""
        self.quiet_until = max(self.quiet_until, time.monotonic() + seconds)
        self.moved()

    def resume(self) -> None:
        """The bounded phase ended early: from now on silence counts again."""
        self.quiet_until = 0.0
        self.moved()

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since the last sign of life (0 while inside a bounded quiet phase)."""
        now = time.monotonic() if now is None else now
        alive = max(self.last, self.quiet_until)
        if self.queued and self.parent is not None:
            alive = max(alive, self.parent.last, self.parent.quiet_until)
        return max(0.0, now - alive)
