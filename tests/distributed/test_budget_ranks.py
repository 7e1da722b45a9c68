"""Two gloo ranks x two workers share one cache smaller than the dataset: every chunk is
fetched once per node per cold epoch, and the second epoch starts warm."""

from __future__ import annotations

import collections
import json
import os
import re
import time
import uuid

import pytest
import torch.multiprocessing as mp

from asynccache.config import Settings
from asynccache.optimize.api import pool_context
from asynccache.testing.faults import FaultProxy, RequestRecord
from tests.budget_data import fetched_bytes, write_remote
from tests.distributed.budget_ranks import budget_rank_main
from tests.distributed.test_ddp import free_port

ITEMS = 2401  # 172 chunks; not a multiple of ranks x batch, so the last rank is padded
WORLD = 2
# (shuffle, budget as a fraction of the dataset): the hardest case, shuffled windows shared
# across ranks and workers at the smallest budget; tests/test_budget_gets.py runs each
# budget in both orders with one rank.
RUNS = [(True, 0.25)]
pytestmark = pytest.mark.timeout(400)


def chunk_downloads(
    requests: list[RequestRecord], sizes: dict[str, int]
) -> collections.Counter[str]:
    """Downloads of whole chunks, by chunk name: GETs of a chunk file without a range or
    of one whole part (from a part boundary to the next, or to the chunk's end). A reader
    may also fetch a chunk's header and a few items by range before the chunk lands
    (``first_read_bytes``); those are never cached, and not counted here."""
    part = Settings().part_bytes
    out: collections.Counter[str] = collections.Counter()
    for r in requests:
        name = os.path.basename(r.path)
        if r.method != "GET" or name not in sizes:
            continue
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", r.range or "")
        if m is not None:
            start, end = int(m.group(1)), int(m.group(2)) + 1
            if start % part or end != min(start + part, sizes[name]):
                continue
        out[name] += 1
    return out


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
        # ranks forked from optimize's fork server (torch.distributed and this rank module
        # preloaded: tests/conftest.py names them before any test starts the server)
        pool_context()
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
        sizes = {c.filename: c.bytes for c in remote.index.chunks}
        cold = chunk_downloads(slices[2 * k], sizes)
        warm = chunk_downloads(slices[2 * k + 1], sizes)
        assert cold == dict.fromkeys(remote.chunk_names, 1), (shuffle, fraction, cold)
        again = fetched_bytes(warm, remote)
        # Epoch 2 starts warm: each chunk at most once, and what the budget kept is not
        # fetched again (within 1.1 x). The ranks' new workers start one after the other:
        # the board slots of a rank not started yet still name the last epoch, and are
        # read as this epoch's start (PlanPolicy), not as a last window being read.
        assert max(warm.values(), default=0) <= 1, (shuffle, fraction, warm)
        assert again <= 1.1 * (remote.total - budget), (shuffle, fraction, again, budget, warm)
