"""Pins, hand-overs and evictions of one process's store, in any order (hypothesis).

A model counts, for each chunk, the pins its readers hold and the hand-overs no reader has
taken yet (each with its deadline, on a clock the test moves); the store must agree after
every step: ``pinned()`` is the model's count, a chunk with any pin survives every evictor
(this process's, which first releases the stale hand-overs, and another process's, which
cannot), a chunk with none is evicted by either, and a reader's pin takes over the newest
hand-over left. Stop points: before or after a hand-over expires, a pin taken over or
not, the last unpin, an eviction between a hand-over and its pin.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asynccache.cache import store as store_mod
from asynccache.cache.store import ChunkStore

pytestmark = pytest.mark.timeout(120)

NAMES = ("chunk-0-0.bin", "chunk-0-1.bin")
SIZE = 100


class _Clock:
    """``time`` as store.py sees it, with ``monotonic`` moved on by the test."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class Pins(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = _Clock()
        self._real_time = store_mod.time
        store_mod.time = self.clock  # type: ignore[assignment]
        self.dir = Path(tempfile.mkdtemp(prefix="asynccache-pins-"))
        self.store = ChunkStore(self.dir / "ds", max_cache_bytes=1 << 20)
        self.other = ChunkStore(self.dir / "ds", max_cache_bytes=1)  # another process
        self.readers = dict.fromkeys(NAMES, 0)  # pins the readers hold
        self.handed: dict[str, list[float]] = {n: [] for n in NAMES}  # deadlines, in order
        self.here: set[str] = set()
        for name in NAMES:
            self._publish(name)

    def teardown(self) -> None:
        store_mod.time = self._real_time
        self.store.close()
        self.other.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _publish(self, name: str) -> None:
        tmp = self.store.create_temp(name, SIZE)
        tmp.pwrite(b"x" * SIZE, 0)
        tmp.publish()
        self.here.add(name)

    def _count(self, name: str) -> int:
        return self.readers[name] + len(self.handed[name])

    def _release_stale(self) -> None:
        """What the store does first in a pin, a hand-over and its own eviction."""
        now = self.clock.monotonic()
        for name in NAMES:
            self.handed[name] = [d for d in self.handed[name] if d >= now]

    @rule(name=st.sampled_from(NAMES))
    def publish_again(self, name: str) -> None:
        if name not in self.here:
            self._publish(name)  # fetched again after an eviction

    @rule(name=st.sampled_from(NAMES))
    def hand_over(self, name: str) -> None:
        self._release_stale()
        got = self.store.hand_over(name)
        assert got == (name in self.here)
        if got:
            self.handed[name].append(self.clock.monotonic() + store_mod._HANDOFF_S)

    @rule(name=st.sampled_from(NAMES))
    def pin(self, name: str) -> None:
        self._release_stale()
        path = self.store.pin(name)
        assert (path is not None) == (name in self.here)
        if path is None:
            return
        assert os.path.samefile(path, self.store.path(name))
        if self.handed[name]:
            self.handed[name].pop()  # the newest hand-over becomes this reader's pin
        self.readers[name] += 1

    @precondition(lambda self: any(self.readers.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n in NAMES if self.readers[n]]))
        self.store.unpin(name)
        self.readers[name] -= 1

    @rule(seconds=st.sampled_from([0.5, 4.0, 9.0, 11.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.ahead += seconds

    @rule()
    def another_process_evicts(self) -> None:
        # It cannot release this process's hand-overs, stale or not: their locks hold.
        asyncio.run(self.other.make_room(SIZE))
        self.here = {n for n in self.here if self._count(n) > 0}

    @rule()
    def this_process_evicts(self) -> None:
        self._release_stale()
        asyncio.run(self.store.make_room(1 << 20))
        self.here = {n for n in self.here if self._count(n) > 0}

    @invariant()
    def store_agrees(self) -> None:
        want = {n: self._count(n) for n in NAMES if self._count(n)}
        assert self.store.pinned() == want
        for name in NAMES:
            assert self.store.is_cached(name, SIZE) == (name in self.here), name


def test_pins_and_hand_overs_in_any_order() -> None:
    run_state_machine_as_test(
        Pins,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
