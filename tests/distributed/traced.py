"""A rank that can be asked for its stacks: ``launch`` starts every rank through
:func:`traced`, and on a hang sends ``SIGUSR1`` to each rank and its forked workers, which
write every thread's Python stack to ``stacks-rank{N}.txt`` in the run's output folder."""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Callable
from typing import Any


def stacks_path(out: str, rank: int) -> str:
    return os.path.join(out, f"stacks-rank{rank}.txt")


def traced(rank: int, main: Callable[..., None], out: str, *args: Any) -> None:
    """Run ``main(rank, *args)`` with its stacks on ``SIGUSR1`` (forked children inherit it)."""
    f = open(stacks_path(out, rank), "w")  # open for the life of the rank
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    main(rank, *args)


def stuck_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """A rank that never finishes, with a forked child that never finishes either."""
    import multiprocessing
    import time

    child = multiprocessing.get_context("fork").Process(target=_child_waits, daemon=True)
    child.start()
    with open(os.path.join(cfg["out"], f"child-{rank}.pid"), "w") as f:
        f.write(str(child.pid))
    while True:
        time.sleep(0.1)


def _child_waits() -> None:
    import time

    while True:
        time.sleep(0.1)
