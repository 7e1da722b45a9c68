"""One asyncio loop on one named daemon thread per process, reached through Futures.

Sync code (dataset ``__getitem__``, DataLoader workers, the writer) never runs a loop of its
own: it hands coroutines to :class:`LoopThread` and waits on ``concurrent.futures.Future``s.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ..errors import BridgeError, StorageTimeoutError

__all__ = ["LoopThread", "get_loop_thread"]

T = TypeVar("T")
Closer = Callable[[], Awaitable[Any]]

log = logging.getLogger(__name__)

THREAD_NAME = "asynccache-io"
_START_TIMEOUT_S = 10.0


class LoopThread:
    """The I/O thread: one event loop, started lazily, owned by the process that made it.

    Invariants:
        * At most one loop thread runs per ``LoopThread`` object; it is named
          ``asynccache-io`` and is a daemon, so it never keeps an interpreter alive.
        * The object belongs to the process that created it. After ``fork`` it is dead in
          the child: every method raises :class:`BridgeError` there, and
          :func:`get_loop_thread` hands the child a fresh instance. The parent's loop,
          sessions and sockets are never touched from a child.
        * Cancelling a Future returned by :meth:`submit` cancels the coroutine on the loop.
        * Every blocking wait is bounded: :meth:`call` needs a timeout, :meth:`close` too.
        * :meth:`call` from the loop thread itself raises :class:`BridgeError` instead of
          deadlocking.
        * :meth:`close` awaits every registered closer (newest first) and every close
          scheduled by :meth:`close_soon` on the loop, then stops the loop and joins the
          thread. It is idempotent; a closed object cannot be restarted.
        * Closers are held only while registered: an object that closes itself (or is
          garbage-collected and closed through :meth:`close_soon`) unregisters first, so
          the number of closers tracks live objects, not every object ever made.
    """

    def __init__(self, name: str = THREAD_NAME) -> None:
        self._name = name
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._closers: list[Closer] = []
        self._closing: set[asyncio.Future[Any]] = set()  # closes scheduled by close_soon
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._loop else "idle")
        return f"<LoopThread {self._name} pid={self._pid} {state} closers={len(self._closers)}>"

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, starting the thread on first use."""
        self._check_owner()
        with self._lock:
            if self._closed:
                raise BridgeError("the asynccache I/O thread is closed")
            if self._loop is None:
                self._start_locked()
            assert self._loop is not None
            return self._loop

    def _start_locked(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()
                    self._stopped.set()

        thread = threading.Thread(target=run, name=self._name, daemon=True)
        thread.start()
        if not ready.wait(_START_TIMEOUT_S):
            raise BridgeError(f"the I/O thread did not start within {_START_TIMEOUT_S}s")
        self._loop, self._thread = loop, thread

    def in_loop_thread(self) -> bool:
        """True when the caller runs on this object's I/O thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise BridgeError(
                "this LoopThread belongs to the parent process; use get_loop_thread() "
                "in the child to get its own"
            )

    # -- the bridge ----------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; cancelling the Future cancels the coroutine."""
        try:
            loop = self.loop
        except BaseException:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout`` seconds for its result.

        Raises:
            BridgeError: called from the I/O thread itself (it would wait on itself).
            StorageTimeoutError: no result within ``timeout``; the coroutine is cancelled.
        """
        if self.in_loop_thread():
            coro.close()
            raise BridgeError(
                "LoopThread.call() from inside the I/O thread would deadlock; await the "
                "coroutine instead"
            )
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            if fut.done():  # the coroutine's own error (TimeoutError is that class too)
                raise
            fut.cancel()
            raise StorageTimeoutError(f"operation did not finish within {timeout}s") from exc

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run the plain callable ``fn(*args)`` on the loop, without waiting."""
        self.loop.call_soon_threadsafe(fn, *args)

    # -- shutdown ------------------------------------------------------------------------
    def register_closer(self, closer: Closer) -> Callable[[], None]:
        """Await ``closer()`` on the loop at :meth:`close`; returns a function that unregisters.

        Storage backends register their ``close`` here so sessions are closed before the
        loop stops (no "Unclosed client session" warnings at exit).
        """
        self._check_owner()
        with self._lock:
            self._closers.append(closer)

        def unregister() -> None:
            with self._lock:
                if closer in self._closers:
                    self._closers.remove(closer)

        return unregister

    @property
    def closer_count(self) -> int:
        """How many closers are registered now (they run at :meth:`close`)."""
        with self._lock:
            return len(self._closers)

    def close_soon(self, closer: Closer) -> None:
        """Await ``closer()`` on the loop soon, without waiting; never blocks, never raises.

        Safe from any thread, the I/O thread and a garbage-collection finalizer included.
        A no-op in a forked child (the loop is the parent's) and once the loop is closed
        or was never started (nothing of it can be open then). :meth:`close` waits for
        closes still running.
        """
        self.post(self._start_close, closer)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon; takes no lock, never blocks, never raises.

        For garbage-collection finalizers: a collection can run on a thread that holds
        any lock of ours at that moment, so a finalizer must not take one itself; it
        posts its work here instead. A no-op in a forked child and when no loop runs.
        """
        if os.getpid() != self._pid:
            return
        loop = self._loop
        if loop is None or self._closed:
            return
        with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
            loop.call_soon_threadsafe(fn, *args)

    def _start_close(self, closer: Closer) -> None:
        fut = asyncio.ensure_future(_guarded(closer))
        self._closing.add(fut)
        fut.add_done_callback(self._closing.discard)

    def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every close scheduled so far has finished."""

        async def closing() -> None:
            await asyncio.sleep(0)  # closes scheduled just before this run first
            while self._closing:
                await asyncio.wait(set(self._closing))

        if self._loop is not None and not self._closed:
            self.call(closing(), timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Close registered resources, stop the loop and join the thread. Idempotent."""
        if os.getpid() != self._pid:
            return  # a forked copy: the thread does not exist here, and the loop is not ours
        if self.in_loop_thread():
            raise BridgeError("LoopThread.close() cannot run on the I/O thread itself")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
            closers, self._closers = list(reversed(self._closers)), []
        if loop is None or thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(_run_closers(closers, self._closing), loop)
        try:
            fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            log.warning("asynccache: closing I/O resources took longer than %ss", timeout)
        except Exception:
            log.exception("asynccache: error while closing I/O resources")
        loop.call_soon_threadsafe(_cancel_all_and_stop, loop)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("asynccache: the I/O thread did not stop within %ss", timeout)


async def _guarded(closer: Closer) -> None:
    try:
        await closer()
    except Exception:
        log.exception("asynccache: a resource failed to close")


async def _run_closers(closers: list[Closer], closing: set[asyncio.Future[Any]]) -> None:
    for closer in closers:
        await _guarded(closer)
    while closing:  # closes scheduled by close_soon (objects collected just before exit)
        await asyncio.wait(set(closing))
    await asyncio.sleep(0)  # let transports finish closing (aiohttp recommends a tick)


def _cancel_all_and_stop(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if not tasks:
        loop.stop()
        return

    async def wait_and_stop() -> None:
        await asyncio.wait(tasks, timeout=5.0)
        loop.stop()

    loop.create_task(wait_and_stop())


# -- the process's instance ------------------------------------------------------------------
class _State:
    """The process-wide slot for the current LoopThread (one explicit object, not globals)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instance: LoopThread | None = None
        # Instances inherited over fork are kept referenced forever, so their sessions are
        # never garbage-collected (and never warn) in a child that cannot close them.
        self.abandoned: list[LoopThread] = []

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        if self.instance is not None:
            self.abandoned.append(self.instance)
        self.instance = None


_state = _State()


def get_loop_thread() -> LoopThread:
    """The LoopThread of this process, created on first use (a fresh one after fork)."""
    with _state.lock:
        if _state.instance is None or _state.instance._closed:
            _state.instance = LoopThread()
        return _state.instance


def _close_at_exit() -> None:
    instance = _state.instance
    if instance is not None:
        instance.close()


os.register_at_fork(after_in_child=_state.after_fork_in_child)
atexit.register(_close_at_exit)
