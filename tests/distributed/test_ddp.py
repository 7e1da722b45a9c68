"""Real gloo process groups streaming from SeaweedFS: coverage, equal ranks, resume."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import signal
import socket
import time

import pytest
import torch.multiprocessing as mp

from asynccache import CacheDataLoader
from asynccache.config import Settings
from asynccache.optimize.api import pool_context
from asynccache.write.upload import upload
from tests.distributed.ranks import rank_main
from tests.distributed.traced import stacks_path, stuck_main, traced
from tests.loader.datasets import DictDataset

N, B = 101, 4
pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    world: int, cfg: dict, timeout: float = 240, main=rank_main, start_method: str = "spawn"
) -> list[list[dict]]:
    """Run ``world`` ranks of ``main`` to completion (bounded), return each rank's epochs.

    On a hang, the failure shows every rank's and forked worker's Python stacks."""
    os.makedirs(cfg["out"], exist_ok=True)
    ctx = mp.start_processes(
        traced,
        args=(main, cfg["out"], world, free_port(), cfg),
        nprocs=world,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{world} ranks did not finish in {timeout} s: a hang\n"
                    + stacks(ctx, cfg["out"])
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                for pid in [*descendants(p.pid), p.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    out = []
    for r in range(world):
        with open(os.path.join(cfg["out"], f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, parents first (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def stacks(ctx, out: str) -> str:
    """Ask each live rank and its forked workers for their stacks; return them, by rank."""
    for p in ctx.processes:
        if p.is_alive():
            for pid in [p.pid, *descendants(p.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
                time.sleep(0.3)  # one process's dump at a time in the rank's file
    text = []
    for r, p in enumerate(ctx.processes):
        with open(stacks_path(out, r)) as f:
            text.append(f"--- rank {r} ({'alive' if p.is_alive() else p.exitcode}) ---\n{f.read()}")
    return "\n".join(text)


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    list(CacheDataLoader(DictDataset(N), cache_dir=src, chunk_size=9, batch_size=16))
    # the index as writers write it now: version 2, its columns in a sidecar
    assert json.loads((src / "index.json").read_text())["version"] == 2
    bucket = "ddp-" + os.urandom(4).hex()
    objstore.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    upload(src, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    return url, objstore.storage_options


def config(remote, tmp_path, name, **kw):
    url, opts = remote
    return {
        "url": url,
        "storage_options": opts,
        "cache_dir": str(tmp_path / "cache"),
        "out": str(tmp_path / name),
        "batch_size": B,
        "epochs": 2,
        **kw,
    }


def warm_launch(world: int, cfg: dict) -> list[list[dict]]:
    """:func:`launch` with ranks forked from optimize's fork server, which preloads
    torch.distributed and the rank module: a rank starts in a fraction of a spawn's time.
    (The elastic test's first group still starts with spawn.)

    The ranks' DataLoader workers start as the ranks' default (a fork server of each rank's
    own, which imports torch once per rank) unless the config names ``workers_start``:
    the tests start workers each way once, spawn (the elastic test's spawned group), a
    rank's fork server (the first launch of each world size) and fork (the reruns and the
    resumed group, which so skip that import)."""
    pool_context()  # its preload list (tests/conftest.py) names tests.distributed.ranks
    return launch(world, cfg, start_method="forkserver")


@pytest.mark.parametrize("world", [2, 3])
def test_every_sample_once_per_epoch_equal_ranks_reproducible(remote, tmp_path, world):
    # three ranks keep their workers across epochs (each epoch's plan must reach them)
    persistent = world == 3
    first = warm_launch(world, config(remote, tmp_path, "a", persistent=persistent))
    for epoch in range(2):
        per_rank = [first[r][epoch]["keys"] for r in range(world)]
        assert len({len(k) for k in per_rank}) == 1, "every rank takes the same number"
        per_rank_samples = math.ceil(N / world)
        assert all(len(k) == per_rank_samples for k in per_rank)
        assert first[0][epoch]["len"] == math.ceil(per_rank_samples / B)
        flat = [k for keys in per_rank for k in keys]
        assert set(flat) == set(range(N)), "every sample in every epoch"
        assert len(flat) - N == per_rank_samples * world - N, "only the documented padding"
    assert first[0][0]["keys"] != first[0][1]["keys"], "epochs differ"
    # every rank and worker mapped the index's columns from the node's one cached copy
    assert len(glob.glob(str(tmp_path / "cache" / "*" / "index-*.cols"))) == 1
    again = warm_launch(
        world, config(remote, tmp_path, "b", persistent=persistent, workers_start="fork")
    )
    assert again == first, "identical on rerun (workers forked this time, not fork-served)"


def test_elastic_resume_from_two_ranks_to_three(remote, tmp_path):
    state = str(tmp_path / "state.pkl")
    pre = launch(2, config(remote, tmp_path, "pre", epochs=1, stop_after=5, state_path=state))
    post = warm_launch(
        3, config(remote, tmp_path, "post", epochs=2, resume_from=state, workers_start="fork")
    )
    before = [k for r in pre for k in r[0]["keys"]]
    after = [k for r in post for k in r[0]["keys"]]
    assert len(before) == 2 * 5 * B
    assert not set(before) & set(after), "nothing repeated across the restart"
    assert set(before) | set(after) == set(range(N)), "nothing missed"
    assert len(after) - len(set(after)) < 3, "at most the padding of three ranks"
    nxt = [k for r in post for k in r[1]["keys"]]
    assert set(nxt) == set(range(N)), "the next epoch is whole again"


def test_a_hung_launch_shows_every_stack(tmp_path):
    """The bound on a launch fails with each rank's and its forked child's stacks."""
    with pytest.raises(pytest.fail.Exception) as err:
        launch(2, {"out": str(tmp_path)}, timeout=3, main=stuck_main, start_method="forkserver")
    text = str(err.value)
    assert "2 ranks did not finish" in text
    for r in range(2):
        part = text.split(f"--- rank {r} ")[1].split("--- rank")[0]
        assert "in stuck_main" in part and "in _child_waits" in part, part
    for r in range(2):  # and none of them is left running
        pid = int((tmp_path / f"child-{r}.pid").read_text())
        assert wait_gone(pid), f"rank {r}'s child {pid} survived the launch"


def wait_gone(pid: int, bound: float = 10) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False
