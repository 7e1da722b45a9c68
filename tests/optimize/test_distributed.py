"""optimize() on 2 "nodes": 2 processes with separate temp dirs in a real gloo group, to S3."""

from __future__ import annotations

import json
import os
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


def test_two_nodes_write_every_output_exactly_once(objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    node_dirs = [str(tmp_path / f"node{r}") for r in range(2)]
    for d in node_dirs:
        os.makedirs(d)
    cfg = dict(url=url, storage_options=objstore.storage_options, node_dirs=node_dirs, n=N,
               workers=0)  # fmt: skip
    # forkserver, as optimize's own pool: the ranks fork from a clean server process that
    # imported asynccache once (pool_context sets that preload before the server starts)
    pool_context()
    ctx = mp.start_processes(
        rank_main, args=(2, free_port(), cfg), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 200
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish: a hang"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for d in node_dirs:
        with open(os.path.join(d, "result.json")) as f:
            results.append(json.load(f))
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
