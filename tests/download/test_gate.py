"""PriorityGate: the limit holds, waiting readers go first, no slot is lost."""

from __future__ import annotations

import asyncio
import os

import pytest

from asynccache.download.gate import PriorityGate, shared_gate

pytestmark = pytest.mark.timeout(10)


async def test_limit_is_never_exceeded():
    gate = PriorityGate(3)
    inside = peak = 0

    async def work():
        nonlocal inside, peak
        async with gate.slot():
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.001)
            inside -= 1

    await asyncio.gather(*(work() for _ in range(50)))
    assert peak == 3


async def test_urgent_waiters_go_first_and_can_be_promoted_while_queued():
    gate = PriorityGate(1)
    order: list[str] = []
    wanted = {"late-but-urgent": False}
    release = asyncio.Event()

    async def hold():
        async with gate.slot():
            await release.wait()

    async def work(name, urgent):
        async with gate.slot(urgent):
            order.append(name)

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(work(f"prefetch-{i}", lambda: False)) for i in range(3)]
    tasks.append(asyncio.create_task(work("late-but-urgent", lambda: wanted["late-but-urgent"])))
    await asyncio.sleep(0)
    wanted["late-but-urgent"] = True  # a reader starts waiting for it while it queues
    release.set()
    await asyncio.gather(holder, *tasks)
    assert order[0] == "late-but-urgent"
    assert order[1:] == ["prefetch-0", "prefetch-1", "prefetch-2"]


async def test_cancelled_waiters_lose_no_slot():
    gate = PriorityGate(1)
    release = asyncio.Event()

    async def hold():
        async with gate.slot():
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(gate.slot().__aenter__()) for _ in range(3)]
    await asyncio.sleep(0)
    for w in waiters:
        w.cancel()
    release.set()
    await holder
    await asyncio.gather(*waiters, return_exceptions=True)
    async with asyncio.timeout(1):
        async with gate.slot():  # the slot came back
            pass


class Owner:
    """Stands for a loop thread (held weakly by the gates)."""


def test_downloaders_of_one_loop_share_a_gate_and_a_forked_child_gets_its_own():
    owner, other = Owner(), Owner()
    gate = shared_gate(owner, 4)
    assert shared_gate(owner, 4) is gate, "one limit per process and loop"
    assert shared_gate(owner, 2) is not gate, "a dataset with its own limit has its own gate"
    assert shared_gate(other, 4) is not gate, "another loop thread, another gate"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's gates (and their holders) are not its own
        os.close(r)
        os.write(w, b"1" if shared_gate(owner, 4) is not gate else b"0")
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1", "a forked child starts with fresh gates"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
