"""Two gloo ranks share one cache smaller than the dataset: the second epoch starts warm
(hypothesis over the workers, order, budget and how the cache dir is given; see
tests/test_budget_warm.py for one rank). Whole-chunk downloads are counted at a real
proxy, the two epochs of each run split at rank 0's markers."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
import torch.multiprocessing as mp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asynccache.optimize.api import pool_context
from asynccache.sampling.order import OrderSpec
from asynccache.testing.faults import FaultProxy
from tests.budget_data import bounds, whole_downloads, write_chunks
from tests.distributed.budget_ranks import warm_rank_main
from tests.distributed.test_ddp import free_port

WORLD = 2
PER, BATCH = 16, 16
pytestmark = pytest.mark.timeout(600)

runs = st.fixed_dictionaries(
    {
        "shuffle": st.booleans(),
        "fraction": st.sampled_from([0.25, 0.5, 0.75]),
        "workers": st.sampled_from([0, 2]),
        "persistent": st.booleans(),
        "relative": st.booleans(),
    }
)


@settings(
    max_examples=1,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(chunks=st.integers(40, 200), drawn=st.lists(runs, min_size=1, max_size=2))
@example(
    chunks=82,
    drawn=[
        {"shuffle": True, "fraction": 0.5, "workers": 2, "persistent": False, "relative": True},
        {"shuffle": False, "fraction": 0.5, "workers": 2, "persistent": True, "relative": True},
    ],
)
def test_two_ranks_start_the_next_epoch_warm(objstore, tmp_path_factory, chunks, drawn):
    tmp = tmp_path_factory.mktemp("warm-ranks")
    remote = write_chunks(objstore, str(tmp / "src"), f"wr-{uuid.uuid4().hex[:8]}", chunks, PER)
    # Budgets of two chunks per reader or more (below: refused, see test_budget_warm.py).
    chunk = max(c.bytes for c in remote.index.chunks)
    drawn = [
        r
        for r in drawn
        if int(remote.total * r["fraction"]) >= 2 * WORLD * max(1, r["workers"]) * chunk
    ]
    if not drawn:
        return
    with FaultProxy(objstore.endpoint_url) as proxy:
        cfg = {
            "url": remote.url,
            "storage_options": dict(objstore.storage_options, endpoint_url=proxy.url),
            "proxy": proxy.url,
            "cache_dir": str(tmp / "cache"),
            "out": str(tmp / "out"),
            "total": remote.total,
            "batch_size": BATCH,
            "runs": drawn,
        }
        os.makedirs(cfg["out"])
        pool_context()  # ranks fork from a server that preloaded torch.distributed
        ctx = mp.start_processes(
            warm_rank_main,
            args=(WORLD, free_port(), cfg),
            nprocs=WORLD,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + 500
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
    slices, start = [], 0
    for i, rec in enumerate(log):
        if "epoch-marker" in rec.path:
            slices.append(log[start:i])
            start = i + 1
    assert len(slices) == 2 * len(drawn)
    for k, run in enumerate(drawn):
        budget = int(remote.total * run["fraction"])
        window = ranks[0][k]["window"]
        assert ranks[1][k]["window"] == window, "the ranks read one order"
        for epoch in range(2):
            keys = ranks[0][k]["keys"][epoch] + ranks[1][k]["keys"][epoch]
            assert set(keys) == set(range(remote.index.total_items)), (run, epoch)
        b = bounds(
            remote.index, OrderSpec(11, run["shuffle"], window), budget, WORLD, run["workers"],
            BATCH,
        )  # fmt: skip
        cold, _ = whole_downloads(slices[2 * k], remote)
        warm, _ = whole_downloads(slices[2 * k + 1], remote)
        say = (
            f"{remote.index.num_chunks} chunks, {run}, window {window}: epoch 1 "
            f"{cold / b.dataset:.3f} (at most {b.cold / b.dataset:.3f}), epoch 2 "
            f"{warm / b.dataset:.3f} (at most {b.warm / b.dataset:.3f}; target "
            f"{b.target / b.dataset:.3f})"
        )
        print(say)
        assert cold <= b.cold, say
        assert warm <= b.warm, say
