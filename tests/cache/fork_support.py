"""Child processes for the fork tests: started while the parent holds a lock, kept alive."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from typing import Any

_WAIT_S = 60.0


def wait_until_told(ready: Any, go: Any) -> None:
    """The child: say it is up, then block until the parent says go (bounded)."""
    ready.set()
    go.wait(_WAIT_S)


@contextlib.contextmanager
def live_child(ctx: BaseContext) -> Iterator[Any]:
    """A child process started now, alive until the block ends (then joined, bounded)."""
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=wait_until_told, args=(ready, go), daemon=True)  # type: ignore[attr-defined]
    proc.start()
    try:
        assert ready.wait(_WAIT_S), "the child never started"
        yield proc
    finally:
        go.set()
        proc.join(_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_WAIT_S)
    assert proc.exitcode == 0


def lock_is_free(path: str | os.PathLike[str]) -> bool:
    """A fresh open file description can take an exclusive flock on ``path`` at once."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
