"""``Connection``: what one dataset holds open in one process, closed exactly once.

A remote dataset needs a storage backend (an HTTP session on the process's I/O thread),
a chunk store (pin descriptors) and a downloader (tasks on that loop). They belong to the
process that made them. A ``Connection`` bundles them so that an explicit ``close()``,
garbage collection of the dataset, and interpreter exit all release them the same way.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable

from ..bridge import LoopThread
from ..cache.store import ChunkStore
from ..storage.base import Storage
from .downloader import Downloader

__all__ = ["CANCEL_WAIT_S", "Connection"]

#: How long :meth:`Connection.close` waits for its downloads to end once cancelled. A
#: cancelled part stops at once; a chunk in its verify and publish finishes them first.
CANCEL_WAIT_S = 10.0


class Connection:
    """A storage backend, and lazily a store and downloader, of one process.

    Invariants:
        * ``pid`` is the process that made it. In any other process (a forked child)
          :meth:`close` does nothing: the session lives on the parent's loop, and the
          parent's loop thread, abandoned in the child, keeps it referenced there.
        * While open it is registered once with its loop thread, so the loop's
          :meth:`~LoopThread.close` at exit closes it; :meth:`close` unregisters it, so a
          closed connection holds no place in the loop thread.
        * ``pinned`` counts the pins taken through this connection, so a pin is only ever
          released into the store that granted it (not into a later connection's store
          after a close or a fork).
        * :meth:`close` is idempotent and final: called from any thread but the I/O
          thread, it cancels the downloads and waits for them to end (bounded by
          :data:`CANCEL_WAIT_S`; a chunk whose verify and publish had begun is published
          first), then releases the pins, so no chunk lands in the cache after it returns
          and the store's close trims what is there. The session is closed later on the
          I/O thread (``close_soon``). On the I/O thread itself (at interpreter exit, or
          posted there by a garbage-collection finalizer, since a collection may run while
          a lock it takes is held) it cannot wait: the downloads are cancelled after the
          pins are released, as the I/O thread gets to it.
    """

    def __init__(self, storage: Storage, loop_thread: LoopThread) -> None:
        self.pid = os.getpid()
        self.storage = storage
        self.store: ChunkStore | None = None
        self.downloader: Downloader | None = None
        self.pinned: collections.Counter[str] = collections.Counter()
        # Pins given back before the reader released them (it was done with the chunk by
        # the plan); the reader's later releases of them are no-ops.
        self.released_early: collections.Counter[str] = collections.Counter()
        self._lt = loop_thread
        self._mu = threading.Lock()
        self._closed = False
        self._unregister: Callable[[], None] = loop_thread.register_closer(self._aclose)

    @property
    def loop_thread(self) -> LoopThread:
        return self._lt

    @property
    def closed(self) -> bool:
        return self._closed

    def attach(self, store: ChunkStore, downloader: Downloader) -> None:
        """Hold ``store`` and ``downloader`` (made over :attr:`storage`) until closed."""
        self.store, self.downloader = store, downloader

    def close(self) -> None:
        """Cancel the downloads and release everything, without waiting for the session
        to finish closing. The caller must not hold a lock that the I/O thread may take
        (a reservation on a full disk calls the dataset's ``shed``)."""
        if self.pid != os.getpid():
            return  # a forked child: nothing here is ours to close
        with self._mu:
            if self._closed:
                return
            self._closed = True
        self._unregister()
        if self.downloader is not None and not self._lt.in_loop_thread():
            self.downloader.close(CANCEL_WAIT_S)  # before the pins: nothing lands after
        if self.store is not None:
            self.store.close()
        self._lt.close_soon(self._aclose)

    async def _aclose(self) -> None:
        self._closed = True
        if self.downloader is not None:
            await self.downloader.aclose()  # downloads first: they use the session
        await self.storage.close()
