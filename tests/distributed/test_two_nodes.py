"""Two nodes simulated on one machine: four real gloo ranks launched as torchrun launches
two nodes of two (``LOCAL_WORLD_SIZE=2``, ``LOCAL_RANK``), ranks 0-1 with cache dir A and a
counting proxy in front of the store, ranks 2-3 with cache dir B and another proxy.

* each node plans its own readers: its plan's minimum is that of its two ranks' readers,
  and a budget below the one-node minimum (two chunks for each of four ranks' readers,
  refused there) but above the per-node one runs;
* per node, each chunk its readers read is fetched at most once in the cold epoch (all
  but those read by range alone), no chunk only the other node reads is fetched, and the
  second epoch stays within the node's warm
  bound (``1.1 x (node's share - budget)``, or :func:`~asynccache.cache.plan.warm_bound`);
* both nodes read one order (the same shuffle window), every sample once an epoch;
* a state does not depend on the node layout;
* without ``LOCAL_WORLD_SIZE`` (or with a ``LOCAL_RANK`` that is not ``rank % 2``) the
  nodes come from the hostnames, gathered over the group: one node here.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import uuid

import pytest

from asynccache.optimize.api import pool_context
from asynccache.read.readplan import EpochSpec, PlanCache, ReaderPlace, budget_bounds
from asynccache.sampling.nodes import NodeLayout
from asynccache.sampling.order import OrderSpec
from asynccache.testing.faults import FaultProxy, RequestRecord
from tests.budget_data import Remote, write_chunks
from tests.distributed.node_ranks import LOCAL, node_rank_main
from tests.distributed.test_ddp import launch

WORLD, WORKERS, BATCH, WINDOW = 4, 2, 8, 4
CHUNKS, PER = 40, 16
pytestmark = pytest.mark.timeout(300)


def node_spec(remote: Remote, node: int, window: int) -> EpochSpec:
    """Node ``node``'s way of reading epoch 0 (ranks ``2 node``, ``2 node + 1``)."""
    layout = NodeLayout(((0, 1), (2, 3)), node)
    place = ReaderPlace(
        0, ((0, remote.index.total_items),), 0, WORLD, node * LOCAL, WORKERS, 0, BATCH, False,
        nodes=layout,
    )  # fmt: skip
    return EpochSpec(place, OrderSpec(5, True, window))


def downloads(requests: list[RequestRecord], remote: Remote) -> collections.Counter[str]:
    """Whole-chunk GETs per chunk (a chunk here is one part: no range, or all of it); the
    reader's range reads of its first items are not downloads."""
    sizes = {c.filename: c.bytes for c in remote.index.chunks}
    out: collections.Counter[str] = collections.Counter()
    for r in requests:
        name = os.path.basename(r.path)
        if r.method != "GET" or name not in sizes:
            continue
        if r.range in (None, "", f"bytes=0-{sizes[name] - 1}"):
            out[name] += 1
    return out


def epochs(log: list[RequestRecord]) -> list[list[RequestRecord]]:
    cut = [i for i, r in enumerate(log) if "epoch-marker" in r.path]
    assert len(cut) == 2, "both epochs marked"
    return [log[: cut[0]], log[cut[0] + 1 : cut[1]]]


def test_two_nodes_each_plan_their_own_readers(objstore, tmp_path):
    remote = write_chunks(
        objstore, str(tmp_path / "src"), f"nodes-{uuid.uuid4().hex[:8]}", CHUNKS, PER
    )
    chunk = max(c.bytes for c in remote.index.chunks)
    # Two chunks per reader: 16 for one node of four ranks x 2 workers, 8 for a node of two.
    budget = 13 * chunk
    assert 2 * chunk * LOCAL * WORKERS <= budget < 2 * chunk * WORLD * WORKERS
    with FaultProxy(objstore.endpoint_url) as pa, FaultProxy(objstore.endpoint_url) as pb:
        cfg = {
            "url": remote.url,
            "storage_options": objstore.storage_options,
            "proxies": [pa.url, pb.url],
            "cache": str(tmp_path / "cache"),
            "out": str(tmp_path / "out"),
            "budget": budget,
            "roomy": 2 * remote.total,
            "window": WINDOW,
            "batch_size": BATCH,
            "workers": WORKERS,
        }
        pool_context()  # ranks fork from a server that preloaded torch.distributed
        ranks = launch(WORLD, cfg, timeout=240, main=node_rank_main, start_method="forkserver")
        logs = [list(pa.requests), list(pb.requests)]

    window = ranks[0]["window"]
    assert all(r["window"] == window for r in ranks), "both nodes read one order"
    for e in range(2):
        keys = [k for r in ranks for k in r["keys"][e]]
        assert sorted(keys) == list(range(remote.index.total_items)), f"epoch {e}"
    for r, rec in enumerate(ranks):
        assert rec["nodes"] == {"groups": [[0, 1], [2, 3]], "mine": r // LOCAL}
        # Each node's plan has its two ranks' readers, not the world's eight.
        assert (rec["readers"], rec["me"]) == (LOCAL * WORKERS, r % LOCAL * WORKERS + 1)
        assert rec["state_two_nodes"] == rec["state_one_node"]
        assert rec["by_host"] == [0] * WORLD and rec["by_host_mismatch"] == [0] * WORLD
        # One node of four ranks refuses this budget (below two chunks per reader).
        assert re.search(r"below the minimum of \d+ bytes .* for 8 readers", rec["one_node"])

    for node in range(2):
        spec = node_spec(remote, node, window)
        plans = PlanCache(remote.index, spec)
        this, following = plans(0, 0), plans(1, 0)
        assert this is not None and following is not None
        one_node = dataclasses.replace(spec.place, nodes=None)
        world_min = PlanCache(remote.index, EpochSpec(one_node, spec.order))(0, 0)
        assert world_min is not None and this.min_bytes < world_min.min_bytes
        assert max(this.min_bytes, following.min_bytes) <= budget, "each chunk once: the plan fits"
        cold_log, warm_log = epochs(logs[node])
        cold, warm = downloads(cold_log, remote), downloads(warm_log, remote)
        share = {remote.index.filename(c) for st in this.streams for c in st.chunks.tolist()}
        assert set(cold) <= share, f"node {node} fetched a chunk only the other node reads"
        # (A chunk its readers take only a few items of in their first batches may be read
        # by range alone, and never downloaded whole.)
        assert len(share - set(cold)) <= LOCAL * WORKERS, f"node {node} fetched too little"
        assert max(cold.values()) == 1, f"node {node}: a chunk fetched twice in one epoch"
        assert len(share) < CHUNKS, "a node reads its share, not the dataset"
        size = {c.filename: c.bytes for c in remote.index.chunks}
        _, warm_bound = budget_bounds(remote.index, spec, budget)
        got = sum(size[n] * k for n, k in warm.items())
        share_bytes = sum(size[n] for n in share)
        print(
            f"node {node}: share {share_bytes / remote.total:.3f} of the dataset, epoch 2 "
            f"fetched {got / remote.total:.3f} (bound {warm_bound / remote.total:.3f}; target "
            f"{1.1 * (share_bytes - budget) / remote.total:.3f})"
        )
        assert got <= warm_bound
