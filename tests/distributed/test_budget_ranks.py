"""Two gloo ranks x two workers share one cache smaller than the dataset: every chunk is
fetched once per node per cold epoch, and the second epoch starts warm."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
import torch.multiprocessing as mp

from asynccache.optimize.api import _PRELOAD, pool_context
from asynccache.testing.faults import FaultProxy
from tests.budget_data import chunk_gets, fetched_bytes, write_remote
from tests.distributed.budget_ranks import budget_rank_main
from tests.distributed.test_ddp import free_port

ITEMS = 1201  # 86 chunks; not a multiple of ranks x batch, so the last rank is padded
WORLD = 2
# (shuffle, budget as a fraction of the dataset): the hardest case, shuffled windows shared
# across ranks and workers at the smallest budget; tests/test_budget_gets.py runs each
# budget in both orders with one rank.
RUNS = [(True, 0.25)]
pytestmark = pytest.mark.timeout(400)


def test_two_ranks_fetch_each_chunk_once_per_cold_epoch(objstore, tmp_path):
    remote = write_remote(objstore, str(tmp_path / "src"), f"ranks-{uuid.uuid4().hex[:8]}", ITEMS)
    runs = RUNS
    with FaultProxy(objstore.endpoint_url) as proxy:
        cfg = {
            "url": remote.url,
            "storage_options": dict(objstore.storage_options, endpoint_url=proxy.url),
            "proxy": proxy.url,
            "cache_dir": str(tmp_path / "cache"),
            "out": str(tmp_path / "out"),
            "total": remote.total,
            "batch_size": 8,
            "window": 2,
            "runs": runs,
        }
        os.makedirs(cfg["out"])
        # ranks forked from optimize's fork server (torch.distributed preloaded)
        pool_context().set_forkserver_preload([*_PRELOAD, "tests.distributed.budget_ranks"])
        ctx = mp.start_processes(
            budget_rank_main,
            args=(WORLD, free_port(), cfg),
            nprocs=WORLD,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + 360
        try:
            while not ctx.join(timeout=1):
                assert time.monotonic() < deadline, "the ranks did not finish: a hang"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        log = proxy.requests
    ranks = []
    for r in range(WORLD):
        with open(os.path.join(cfg["out"], f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    # Split the proxy's log at rank 0's markers: one slice per epoch of each run.
    slices, start = [], 0
    for i, rec in enumerate(log):
        if "epoch-marker" in rec.path:
            slices.append(log[start:i])
            start = i + 1
    assert len(slices) == 2 * len(runs)
    for k, (shuffle, fraction) in enumerate(runs):
        budget = int(remote.total * fraction)
        for epoch in range(2):
            keys = ranks[0][2 * k + epoch] + ranks[1][2 * k + epoch]
            assert set(keys) == set(range(ITEMS)), (shuffle, fraction, epoch)
        cold, warm = chunk_gets(slices[2 * k]), chunk_gets(slices[2 * k + 1])
        assert cold == dict.fromkeys(remote.chunk_names, 1), (shuffle, fraction, cold)
        again = fetched_bytes(warm, remote)
        # Epoch 2 starts warm: it fetches less than the whole dataset. Not asserted here:
        # each chunk at most once in epoch 2 and the 1.1 x (dataset - budget) bound. The
        # one-rank tests (tests/test_budget_gets.py) hold both. With two ranks a rank
        # running ahead can evict what the other still reads (README "Known gaps"): one
        # chunk fetched twice in epoch 2, and 1.1002 x the bound, were each seen once.
        assert again < remote.total, (shuffle, fraction, again, budget, warm)
