"""Data-parallel groups in one process (ranks simulated with the launcher's RANK /
WORLD_SIZE, run one after another; real gloo groups: tests/distributed/test_dp_groups.py):

* ``replication=2`` over 4 ranks reads as 2 DP ranks: replicas get identical batches and
  states, DP ranks disjoint batches that cover the epoch, and a state saved on one replica
  continues on the other exactly; ``data_parallel=(rank, size)`` is the same split.
* The node's read plan counts DP readers: the budget minimum of 4 ranks in 2 replica
  pairs is the minimum of 2 readers, and a budget at it streams.
* ``reads=False`` (a pipeline stage after the first): nothing fetched, iterating refused.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
from typing import Any

import pytest
import torch.distributed as dist

from asynccache import CacheDataLoader, ConfigError, StreamingDataset
from tests.loader.datasets import DictDataset
from tests.loader.test_resume_property import as_rank
from tests.remote_data import upload_dataset, write_dataset

N, CHUNK, BS = 40, 5, 3
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("w")
    list(CacheDataLoader(DictDataset(N), cache_dir=path, chunk_size=CHUNK))
    return path


def keys(batch: Any) -> list[int]:
    return batch["i"].tolist()


def run(path: Any, rank: int, world: int, stop: int | None = None, **kw: Any) -> Any:
    """Rank ``rank``'s batches of two epochs (or of the first ``stop``, and its state)."""
    workers = kw.pop("num_workers", 0)
    with as_rank(rank, world):
        ds = StreamingDataset(path, shuffle=True, seed=2, **kw)
        dl = CacheDataLoader(ds, batch_size=BS, num_workers=workers)
        if stop is None:
            return [[keys(b) for b in dl] for _ in range(2)], len(dl), ds.dp_rank_and_world()
        it = iter(dl)
        head = [keys(next(it)) for _ in range(stop)]
        return head, dl.state_dict()


def resume(path: Any, rank: int, world: int, state: Any, **kw: Any) -> list[list[int]]:
    with as_rank(rank, world):
        dl = CacheDataLoader(StreamingDataset(path, shuffle=True, seed=2, **kw), batch_size=BS)
        dl.load_state_dict(state)
        return [keys(b) for b in dl] + [keys(b) for b in dl]


def test_replicas_read_the_same_batches_and_dp_ranks_split_the_epoch(written):
    out = [run(written, r, 4, replication=2) for r in range(4)]
    assert [o[2] for o in out] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert out[0][0] == out[1][0] and out[2][0] == out[3][0], "replicas: identical batches"
    assert all(o[1] == N // 2 // BS + 1 for o in out), "len(): batches per DP rank"
    for epoch in range(2):
        a = [k for b in out[0][0][epoch] for k in b]
        b = [k for b in out[2][0][epoch] for k in b]
        assert not set(a) & set(b) and sorted(a + b) == list(range(N)), "once per epoch"
    assert out[0][0][0] != out[0][0][1], "epochs differ"
    # the same split given as data_parallel=(dp_rank, dp_size), and with workers
    pair = run(written, 3, 4, data_parallel=(1, 2), num_workers=2)
    plain = run(written, 1, 2, num_workers=2)
    assert pair[0] == plain[0], "(1, 2) reads as DP rank 1 of 2, whatever the global rank"


def test_a_state_saved_on_one_replica_continues_on_the_other(written):
    whole = run(written, 1, 4, replication=2)[0]
    flat = [b for e in whole for b in e]
    head0, state0 = run(written, 0, 4, stop=5, replication=2)
    head1, state1 = run(written, 1, 4, stop=5, replication=2)
    assert head0 == head1 and state0 == state1, "replicas save equal states"
    assert state0["world"] == 2 and state0["stream"]["world"] == 2
    rest = resume(written, 1, 4, state0, replication=2)
    assert head0 + rest == flat, "exact resume from the other replica's state"
    # Under DDP every rank's state is the same: DP rank 1 continues its own part from it.
    other = [b for e in run(written, 2, 4, replication=2)[0] for b in e]
    assert resume(written, 2, 4, state0, replication=2) == other[5:]


def test_bad_data_parallel_arguments(written, tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        StreamingDataset(written, data_parallel=(0, 2), replication=2)
    for bad in [(2, 2), (0,), (-1, 2), ("a", 2)]:
        with pytest.raises(ConfigError, match="data_parallel"):
            StreamingDataset(written, data_parallel=bad)
    with pytest.raises(ConfigError, match="process group"):
        StreamingDataset(written, data_parallel=object())
    with as_rank(1, 4), pytest.raises(ConfigError, match="does not divide"):
        StreamingDataset(written, replication=3)
    with pytest.raises(ConfigError, match="positive integer"):
        StreamingDataset(written, replication=0)


@pytest.fixture
def remote(objstore, bucket, tmp_path) -> str:
    src = write_dataset(tmp_path / "src", N, chunk_size=CHUNK, pad=4096)
    return upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)


def cached_chunks(cache_dir: Any) -> list[str]:
    return [f for _, _, files in os.walk(cache_dir) for f in files if f.endswith(".bin")]


def test_a_stage_that_does_not_read_fetches_nothing(remote, objstore, tmp_path):
    cache = tmp_path / "cache"
    ds = StreamingDataset(
        remote, cache_dir=cache, storage_options=objstore.storage_options, reads=False
    )
    dl = CacheDataLoader(ds, batch_size=BS, num_workers=2)
    assert len(dl) == -(-N // BS)
    state = dl.state_dict()
    dl.load_state_dict(state)
    dl.seek(4)
    with pytest.raises(ConfigError, match="reads=False"):
        iter(dl)
    with pytest.raises(ConfigError, match="reads=False"):
        next(iter(ds))
    assert ds.download_stats()["chunks_fetched"] == 0
    assert cached_chunks(cache) == [], "no chunk downloaded"
    # the reading stage's state loads here and says the same
    reader = StreamingDataset(remote, cache_dir=cache, storage_options=objstore.storage_options)
    rdl = CacheDataLoader(reader, batch_size=BS)
    it = iter(rdl)
    next(it)
    dl.load_state_dict(rdl.state_dict())
    assert dl.state_dict() == rdl.state_dict()


def test_the_node_plan_counts_data_parallel_readers(remote, objstore, tmp_path):
    """Four ranks in two replica pairs share the node's cache as two readers: the budget
    minimum is that of two readers, and a budget at it streams every rank."""

    def first_batch(rank: int, world: int, budget: int, **kw: Any) -> Any:
        with as_rank(rank, world):
            ds = StreamingDataset(
                remote,
                cache_dir=tmp_path / "cache",
                storage_options=objstore.storage_options,
                shuffle=True,
                max_cache_bytes=budget,
                **kw,
            )
            return keys(next(iter(CacheDataLoader(ds, batch_size=BS))))

    def minimum(rank: int, world: int, **kw: Any) -> tuple[int, str]:
        with pytest.raises(ConfigError, match="below the minimum") as err:
            first_batch(rank, world, 1, **kw)
        m = re.search(r"minimum of (\d+) bytes .* for (\d+) readers \((\d+) ranks", str(err.value))
        assert m is not None, str(err.value)
        return int(m.group(1)), f"{m.group(2)} readers, {m.group(3)} ranks"

    two, said = minimum(0, 2)
    assert said == "2 readers, 2 ranks"
    four, said = minimum(0, 4)
    assert four > two
    for r in range(4):
        assert minimum(r, 4, replication=2) == (two, "2 readers, 2 ranks"), "DP readers only"
    got = [first_batch(r, 4, two, replication=2) for r in range(4)]
    assert got[0] == got[1] and got[2] == got[3] and got[0] != got[2]


def test_a_group_resolves_where_it_lives_and_nowhere_else(written):
    """A one-rank gloo group in this process: the DP rank and size are the group's; a copy
    pickled into another process (not a DataLoader worker) can't resolve it and says so."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ds = StreamingDataset(written, data_parallel=dist.new_group([0]))
        assert ds.dp_rank_and_world() == (0, 1)
        batches = [keys(b) for b in CacheDataLoader(ds, batch_size=BS, num_workers=1)]
        assert sorted(k for b in batches for k in b) == list(range(N))
        copy = pickle.loads(pickle.dumps(ds))
        with pytest.raises(ConfigError, match="pickled into another process"):
            copy.dp_rank_and_world()
    finally:
        dist.destroy_process_group()
