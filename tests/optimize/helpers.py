"""Module-level ``fn``s for optimize tests (spawned workers import them by name)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np


def items(i: int) -> Any:
    """``i % 3`` items per input (0, 1 or 2): returns, yields and returns nothing."""
    if i % 3 == 0:
        return None
    if i % 3 == 1:
        return {"i": i, "j": 0, "x": np.full(50, i, dtype=np.int32)}
    return _two(i)


def _two(i: int) -> Any:
    for j in range(2):
        yield {"i": i, "j": j, "x": np.full(50, i, dtype=np.int32)}


def expected(inputs: list[int]) -> list[tuple[int, int]]:
    return [(i, j) for i in inputs for j in range(i % 3)]


def tag(x: tuple[str, int]) -> Any:
    """Items tagged with a job name, to tell two jobs' items apart."""
    name, i = x
    return {"name": name, "i": i}


def bad_on_7(i: int) -> Any:
    if i == 7:
        raise ValueError("cannot decode this one")
    return {"i": i}


def bad_midway(i: int) -> Any:
    """Input 5 yields one item, then fails: with skip, none of its items may remain."""
    yield {"i": i}
    if i == 5:
        raise ValueError("broken halfway")
    yield {"i": i}


def logged(x: tuple[int, str, str]) -> Any:
    """Append the input to ``<log_dir>/<pid>`` (what ran); input ``block`` waits for a kill.

    ``x`` is ``(i, log_dir, mode)``: mode ``"hang"`` makes input 30 wait (up to 120 s) while
    ``<log_dir>/hang`` exists; ``"die"`` makes input 30 kill its own worker with SIGKILL
    while ``<log_dir>/die`` exists; ``"gate"`` makes every input wait for ``<log_dir>/go``.
    """
    i, log_dir, mode = x
    if mode == "gate":
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(log_dir, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
    if i == 30 and mode == "hang" and os.path.exists(os.path.join(log_dir, "hang")):
        with open(os.path.join(log_dir, "hanging"), "w"):
            pass
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
    if i == 30 and mode == "die" and os.path.exists(os.path.join(log_dir, "die")):
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(log_dir, f"ran-{os.getpid()}"), "a") as f:
        f.write(f"{i}\n")
    return {"i": i}


def ran(log_dir: str) -> list[int]:
    out: list[int] = []
    for name in os.listdir(log_dir):
        if name.startswith("ran-"):
            with open(os.path.join(log_dir, name)) as f:
                out += [int(line) for line in f.read().split()]
    return out


def small(i: int) -> Any:
    return i


def bad_on_85(i: int) -> Any:
    """Fails on input 85 (in shard 7 of 8: rank 1 of 2)."""
    if i == 85:
        raise ValueError("unreadable record")
    return {"i": i}


def die_on_85(i: int) -> Any:
    """Kills its own process (SIGKILL, no cleanup) on input 85: rank 1 of 2, inline."""
    if i == 85:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"i": i}


def hang_on_3(x: tuple[int, str]) -> Any:
    """Input 3 hangs (``time.sleep(1e6)``) after writing its pid to ``<log_dir>/hung``."""
    i, log_dir = x
    if i == 3:
        with open(os.path.join(log_dir, "hung.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(log_dir, "hung.tmp"), os.path.join(log_dir, "hung"))
        time.sleep(1e6)
    return {"i": i}
