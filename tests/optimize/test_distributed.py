"""optimize() on 2 "nodes": 2 processes with separate temp dirs in a real gloo group, to S3."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest
import torch.multiprocessing as mp

from asynccache import StreamingDataset
from asynccache.optimize.api import pool_context
from tests.optimize import helpers
from tests.optimize.ranks import rank_main

pytestmark = pytest.mark.timeout(240)
N = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(cfg: dict) -> mp.ProcessContext:
    """2 ranks of ``rank_main``, forked from optimize's fork server (clean, like its pool).

    The server preloads this rank module (torch.distributed), so each rank starts warm,
    whichever test started it: tests/conftest.py names it, and ``pool_context`` keeps that
    list.
    """
    pool_context()  # its preload list (tests/conftest.py) names tests.optimize.ranks
    return mp.start_processes(
        rank_main, args=(2, free_port(), cfg), nprocs=2, join=False, start_method="forkserver"
    )


def launch(cfg: dict) -> list[dict]:
    """Run 2 ranks to completion (bounded); each rank's result.json."""
    ctx = start_ranks(cfg)
    deadline = time.monotonic() + 200
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish: a hang"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for d in cfg["node_dirs"]:
        with open(os.path.join(d, "result.json")) as f:
            results.append(json.load(f))
    return results


def node_dirs(tmp_path) -> list[str]:
    out = [str(tmp_path / f"node{r}") for r in range(2)]
    for d in out:
        os.makedirs(d)
    return out


def test_two_nodes_write_every_output_exactly_once(objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    cfg = dict(url=url, storage_options=objstore.storage_options, node_dirs=node_dirs(tmp_path),
               n=N, workers=0)  # fmt: skip
    results = launch(cfg)
    # each rank converted its own shards, both returned after the one commit
    assert all(r["inputs"] > 0 for r in results)
    assert sum(r["inputs"] for r in results) == N
    assert results[0]["generation"] == results[1]["generation"]
    assert [r["staged_left"] for r in results] == [[], []]  # staging emptied on both nodes
    ds = StreamingDataset(
        url, cache_dir=str(tmp_path / "c"), storage_options=objstore.storage_options
    )
    try:
        got = [(int(ds[k]["i"]), int(ds[k]["j"])) for k in range(len(ds))]
    finally:
        ds.close()
    assert got == helpers.expected(list(range(N)))  # every fn output exactly once, in order


def test_an_input_failing_on_one_node_stops_both_and_leaves_nothing(objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    cfg = dict(url=url, storage_options=objstore.storage_options, node_dirs=node_dirs(tmp_path),
               n=N, workers=0, fn="bad_on_85")  # fmt: skip
    results = launch(cfg)
    # input 85 is in shard 7 (78-89), rank 1's; rank 0 (the finisher) reports it too
    assert all("input #85" in r.get("error", "") for r in results), results
    assert all("unreadable record" in r["error"] for r in results)
    assert [r["type"] for r in results] == ["InputFailedError"] * 2
    from asynccache.config import Settings
    from asynccache.optimize.job import call
    from asynccache.storage import open_storage

    storage = open_storage(url, Settings.from_env(progress=False), objstore.storage_options)
    try:
        assert call(storage.list()) == []  # chunks, shard indexes, plan, lease: all gone
    finally:
        call(storage.close())


def test_a_rank_killed_outright_stops_rank_0_naming_it(objstore, bucket, tmp_path):
    """Rank 1 dies by SIGKILL (posts nothing): rank 0 sees its heartbeat's pid gone, at once."""
    url = f"s3://{bucket}/ds"
    cfg = dict(url=url, storage_options=objstore.storage_options, node_dirs=node_dirs(tmp_path),
               n=N, workers=0, fn="die_on_85")  # fmt: skip
    ctx = start_ranks(cfg)
    rank0, rank1 = ctx.processes
    try:
        rank0.join(timeout=200)  # bounded; without the heartbeat it waits 10 minutes
        assert not rank0.is_alive(), "rank 0 did not notice that rank 1 is gone"
        rank1.join(timeout=10)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    assert rank1.exitcode == -9  # the fault fired: rank 1 was killed, not stopped
    with open(os.path.join(cfg["node_dirs"][0], "result.json")) as f:
        res = json.load(f)
    assert res["type"] == "WorkerDiedError", res
    # it died in shard 7, its last; shard 5 may still have been finishing beside it
    assert re.search(r"rank 1 stopped with shards (5, )?7 unfinished", res["error"]), res
    assert not os.path.exists(os.path.join(cfg["node_dirs"][1], "result.json"))
