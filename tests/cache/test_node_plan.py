"""Nodes: ranks grouped by node from LOCAL_WORLD_SIZE / LOCAL_RANK (or hostnames), and the
read plan, budget minimum and board of a node counting only the readers of its ranks.
Pure parts and the launcher's variables, no process group (the gloo job of two simulated
nodes is tests/distributed/test_two_nodes.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.config import local_env
from asynccache.errors import ConfigError
from asynccache.format import Index
from asynccache.read.readplan import EpochSpec, PlanCache, ReaderPlace, fit_window, least_bytes
from asynccache.sampling.nodes import LocalRankMismatch, NodeLayout, by_host, contiguous, layout
from asynccache.sampling.order import OrderSpec
from asynccache.torch import distributed
from asynccache.write.writer import ChunkWriter, merge_dir

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The launcher's variables, cleared first (a test sets those it means)."""
    for k in LAUNCH:
        monkeypatch.delenv(k, raising=False)
    yield monkeypatch


# -- the launcher's variables --------------------------------------------------------------


def test_local_env_reads_and_checks_the_variables():
    assert local_env({}) is None
    assert local_env({"LOCAL_WORLD_SIZE": "8"}) == (None, 8)
    assert local_env({"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == (3, 8)
    for env, name in [
        ({"LOCAL_WORLD_SIZE": "eight"}, "LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
    ]:
        with pytest.raises(ConfigError, match=name):
            local_env(env)


def test_contiguous_nodes_and_their_refusals():
    assert contiguous(5, 8, 1, 4) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert contiguous(5, 8, None, 2) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide"):
        contiguous(0, 8, 0, 3)
    with pytest.raises(LocalRankMismatch, match="LOCAL_RANK=0"):
        contiguous(5, 8, 0, 4)  # rank 5 is local rank 1 of a contiguous layout
    assert by_host(["b", "b", "a", "c", "a"]) == [0, 0, 1, 2, 1]


def test_layout_counts_replicas_once_and_leaves_out_ranks_that_read_nothing():
    # Two nodes of four; replication=2 (TP pairs): DP ranks 0,1 on node 0, 2,3 on node 1.
    nodes = [r // 4 for r in range(8)]
    got = layout(nodes, [r // 2 for r in range(8)], 5)
    assert got == NodeLayout(((0, 1), (2, 3)), 1)
    # Pipeline stages on node 1 read nothing: its group is empty.
    got = layout(nodes, [r if r < 4 else None for r in range(8)], 6)
    assert got is not None and got.groups == ((0, 1, 2, 3), ()) and got.distinct() == [(0, 1, 2, 3)]
    # Replicas across nodes: both nodes read DP ranks 0 and 1 (one plan).
    got = layout(nodes, [r % 2 for r in range(8)], 0)
    assert got is not None and got.distinct() == [(0, 1)]
    assert layout([0, 0, 0], [0, 1, 2], 1) is None  # one node
    assert NodeLayout.from_json(got.to_json()) == got and NodeLayout.from_json(None) is None


def test_nodes_from_the_launchers_variables(launched):
    launched.setenv("RANK", "3")
    launched.setenv("WORLD_SIZE", "4")
    assert distributed.node_of_ranks() is None  # nothing tells: one node
    launched.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed.node_of_ranks() == [0, 0, 1, 1]
    launched.setenv("LOCAL_RANK", "1")
    assert distributed.node_of_ranks() == [0, 0, 1, 1]
    dp = distributed.DataParallel(replication=2)
    assert distributed.node_layout(dp, dp.resolve(), True) == NodeLayout(((0,), (1,)), 1)
    dp = distributed.DataParallel()
    assert distributed.node_layout(dp, dp.resolve(), True) == NodeLayout(((0, 1), (2, 3)), 1)
    # A DP pair without a process group: the other ranks' DP ranks are unknown.
    dp = distributed.DataParallel(data_parallel=(1, 2))
    assert distributed.node_layout(dp, dp.resolve(), True) is None
    launched.setenv("LOCAL_WORLD_SIZE", "4")
    launched.setenv("LOCAL_RANK", "3")
    assert distributed.node_layout(distributed.DataParallel(), (3, 4), True) is None


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 does not divide the world size 4"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "LOCAL_RANK=0 is not rank 3"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside"),
        ({"LOCAL_WORLD_SIZE": "many"}, "LOCAL_WORLD_SIZE='many'"),
    ],
)
def test_bad_launch_variables_name_themselves(launched, env, name):
    launched.setenv("RANK", "3")
    launched.setenv("WORLD_SIZE", "4")
    for k, v in env.items():
        launched.setenv(k, v)
    with pytest.raises(ConfigError, match=name):
        distributed.node_of_ranks()


def test_a_single_rank_is_one_node_whatever_the_variables(launched):
    launched.setenv("LOCAL_WORLD_SIZE", "3")  # (would not divide a world of 4)
    assert distributed.node_of_ranks() is None


# -- the node's plan -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Index]:
    """Written indexes of ``chunks`` chunks of 5 items (items of varied sizes), by count."""
    made: dict[int, Index] = {}
    root = tmp_path_factory.mktemp("indexes")

    def get(chunks: int) -> Index:
        if chunks not in made:
            src = str(root / str(chunks))
            w = ChunkWriter(src, 0, chunk_size=5)
            rng = np.random.default_rng(chunks)
            for i in range(chunks * 5):
                w.add(i, {"i": i, "x": np.zeros(int(rng.integers(100, 600)), np.uint8)})
            w.finish()
            made[chunks] = merge_dir(src, [0])
            assert made[chunks].num_chunks == chunks
        return made[chunks]

    return get


def _place(
    world: int, rank: int, workers: int, nodes: NodeLayout | None, items: int
) -> ReaderPlace:
    return ReaderPlace(0, ((0, items),), 0, world, rank, workers, 0, 4, False, nodes=nodes)


@settings(max_examples=40, deadline=None, database=None)
@given(
    nodes=st.integers(2, 4),
    local=st.integers(1, 3),
    workers=st.integers(1, 3),
    replication=st.sampled_from([1, 2]),
    shuffle=st.booleans(),
    chunks=st.integers(8, 40),
    seed=st.integers(0, 2**16),
)
def test_each_node_plans_exactly_its_ranks_readers(
    indexes, nodes, local, workers, replication, shuffle, chunks, seed
):
    """The node plans, together, are the one-node plan's streams split by node (a DP rank
    replicated over two nodes in both); each node's minimum is at most the one-node
    minimum; every node fits the same window; boards of different nodes differ."""
    world = nodes * local
    if world % replication:
        replication = 1
    index = indexes(chunks)
    order = OrderSpec(seed, shuffle, 3)
    dp_world = world // replication
    node_of = [r // local for r in range(world)]
    lay = layout(node_of, [r // replication for r in range(world)], 0)
    one = PlanCache(index, EpochSpec(_place(dp_world, 0, workers, None, index.total_items), order))(
        0, 0
    )
    assert one is not None
    keys, fitted = set(), set()
    budget = least_bytes(index, dp_world * workers)
    for n in range(nodes):
        group = lay.groups[n] if lay is not None else tuple(range(dp_world))
        place = _place(
            dp_world,
            group[0],
            workers,
            None if lay is None else NodeLayout(lay.groups, n),
            index.total_items,
        )
        spec = EpochSpec(place, order)
        assert spec.ranks == group and spec.readers == len(group) * workers
        plan = PlanCache(index, spec)(0, 0)
        assert plan is not None
        for i, r in enumerate(group):
            for w in range(workers):
                mine, whole = plan.streams[i * workers + w], one.streams[r * workers + w]
                assert np.array_equal(mine.chunks, whole.chunks) and mine.length == whole.length
        assert plan.min_bytes <= one.min_bytes
        assert least_bytes(index, spec.readers) <= least_bytes(index, dp_world * workers)
        keys.add((group, spec.key(index.checksum)))
        fitted.add(fit_window("mem://", index, spec, budget).window)
        me = dataclasses.replace(place, rank=group[-1], worker=workers - 1)
        assert EpochSpec(me, order).me == spec.readers - 1
    assert len({k for _, k in keys}) == len({g for g, _ in keys}), "a board per group of ranks"
    assert len(fitted) == 1, "every node reads with one window"


def test_one_node_keeps_the_board_it_had(indexes):
    """A layout of one node (or none) names the board as before: no node in the key."""
    index = indexes(10)
    order = OrderSpec(1, True, 2)
    plain = EpochSpec(_place(2, 1, 2, None, 50), order)
    laid = EpochSpec(_place(2, 1, 2, NodeLayout(((0, 1),), 0), 50), order)
    assert laid.nodes is None and laid.key(index.checksum) == plain.key(index.checksum)
    # Two nodes each reading every rank (replicas across nodes): the one-node plan too.
    both = EpochSpec(_place(2, 1, 2, NodeLayout(((0, 1), (0, 1)), 1), 50), order)
    assert both.nodes is None and both.key(index.checksum) == plain.key(index.checksum)
    half = EpochSpec(_place(2, 1, 2, NodeLayout(((1,), (0, 1)), 0), 50), order)
    assert half.key(index.checksum) != plain.key(index.checksum) and half.readers == 2
    assert plain.readers == 4 and plain.me == 2
    # A layout of another world (a state saved with more ranks) plans as one node.
    stale = EpochSpec(_place(2, 1, 2, NodeLayout(((0, 1), (2, 3)), 0), 50), order)
    assert stale.nodes is None and stale.readers == 4


def test_the_node_budget_minimum_names_the_node(indexes):
    index = indexes(12)
    lay = NodeLayout(((0, 1), (2, 3)), 1)
    spec = EpochSpec(_place(4, 2, 2, lay, 60), OrderSpec(0, True, 2))
    least = least_bytes(index, 4)
    assert fit_window("mem://d", index, spec, least).window >= 1  # runs at the node's minimum
    with pytest.raises(ConfigError, match=r"for 4 readers \(2 of 4 ranks, read on this node, x 2"):
        fit_window("mem://d", index, spec, least - 1)
    one = EpochSpec(_place(4, 2, 2, None, 60), OrderSpec(0, True, 2))
    with pytest.raises(ConfigError, match=r"for 8 readers \(4 ranks x 2 workers\)"):
        fit_window("mem://d", index, one, least)
