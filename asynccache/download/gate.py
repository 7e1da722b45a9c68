"""A concurrency limit that lets the requests a reader is waiting for go first."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable

from ..bridge import forksafe

__all__ = ["PriorityGate", "shared_gate"]


class PriorityGate:
    """A counting semaphore whose free slots go to urgent waiters first.

    Invariants:
        * At most ``limit`` holders at once.
        * When a slot frees, it goes to the oldest waiter whose ``urgent()`` is true, else
          to the oldest waiter. ``urgent`` is asked at hand-over time, so a prefetch that a
          reader starts waiting for is promoted while it queues.
        * A waiter cancelled after being handed a slot passes the slot on; none is lost.

    Loop-bound: use it from one event loop only.
    """

    def __init__(self, limit: int) -> None:
        self._free = limit
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    @contextlib.asynccontextmanager
    async def slot(self, urgent: Callable[[], bool] = lambda: False) -> AsyncIterator[None]:
        """Hold one slot for the body of the ``async with``."""
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, urgent: Callable[[], bool]) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (urgent, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # handed a slot while being cancelled: pass it on
            else:
                self._waiters.remove(entry)
            raise

    def _release(self) -> None:
        self._free += 1
        while self._free > 0 and self._waiters:
            pick = next((i for i, (urgent, _) in enumerate(self._waiters) if urgent()), 0)
            _, fut = self._waiters.pop(pick)
            if not fut.done():
                self._free -= 1
                fut.set_result(None)

    @property
    def free(self) -> int:
        """Slots nobody holds now."""
        return self._free

    @property
    def waiting(self) -> int:
        """Requests queueing for a slot now."""
        return len(self._waiters)

    def __repr__(self) -> str:
        return f"<PriorityGate free={self._free} waiting={len(self._waiters)}>"


class _SharedGates:
    """The gates of this process, one per I/O loop thread. Reset in a forked child (the
    parent's holders do not exist there, and its mutex may have been held at the fork)."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.gates: weakref.WeakKeyDictionary[object, dict[int, PriorityGate]] = (
            weakref.WeakKeyDictionary()
        )
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self.mu = threading.Lock()
        self.gates = weakref.WeakKeyDictionary()


_SHARED = _SharedGates()


def shared_gate(loop_owner: object, limit: int) -> PriorityGate:
    """The one gate of every downloader whose requests run on ``loop_owner`` (the
    process's I/O loop thread): ``ASYNCCACHE_MAX_CONCURRENCY`` bounds the downloads in
    flight per process, however many datasets (a mix's streams) it reads. Downloaders
    given another limit (a dataset opened with its own ``max_concurrency``) share a gate
    of that limit instead.
    """
    with _SHARED.mu:
        gates = _SHARED.gates.get(loop_owner)
        if gates is None:
            gates = _SHARED.gates[loop_owner] = {}
        gate = gates.get(limit)
        if gate is None:
            gate = gates[limit] = PriorityGate(limit)
        return gate
