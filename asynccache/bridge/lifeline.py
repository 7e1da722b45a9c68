"""A worker process that ends when the process that started it is gone.

A PyTorch DataLoader worker watches its parent with ``os.getppid()``. That is its real
parent only under ``fork``: a worker started by ``forkserver`` has the fork server as its
parent, and the fork server lives as long as any process holds its "alive" pipe, which
every worker it started does. So when the process that owns the DataLoader is killed
outright (``kill -9``, the OOM killer, a launcher tearing a job down), its forkserver
workers and their fork server wait for each other forever, holding memory, mapped chunks
and cache pins.

:func:`exit_with_parent` closes that gap: a daemon thread waits on the sentinel
``multiprocessing`` gives every child of its real parent (a pipe end that reads EOF when
that process exits, however it exits, whatever later reuses its pid) and ends this
process with ``os._exit`` when it fires. The kernel drops the process's locks; its
temporary files are swept by the next process that finds their lock free.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading

__all__ = ["EXIT_CODE", "exit_with_parent", "pid_alive"]

EXIT_CODE = 70  # EX_SOFTWARE: "the process this one worked for is gone"

_watching: list[int] = []  # pid of the process whose watch thread runs (reset by fork)
_lock = threading.Lock()


def exit_with_parent() -> bool:
    """In a process started by ``multiprocessing`` (any start method): end it as soon as
    its parent process exits. Idempotent per process. False where there is no parent to
    watch (the main process)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    with _lock:
        if _watching and _watching[0] == os.getpid():
            return True
        _watching[:] = [os.getpid()]
    sentinel = parent.sentinel
    threading.Thread(
        target=_wait, args=(sentinel,), name="asynccache-lifeline", daemon=True
    ).start()
    return True


def _wait(sentinel: int) -> None:
    try:
        select.select([sentinel], [], [])
    except (OSError, ValueError):  # the sentinel was closed under us: nothing to watch
        return
    os._exit(EXIT_CODE)


def pid_alive(pid: int) -> bool:
    """A process with this pid exists on this host (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
