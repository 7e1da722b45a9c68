"""Drop-in behaviour: a real DataLoader, persistent workers, epochs that advance by
themselves, size strings, and arguments that can't apply raising instead of being ignored."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader

from asynccache import Cache, CacheDataLoader, ConfigError, ResumeStateError, StreamingDataset
from tests.loader.datasets import DictDataset, RandomDataset, key_and_pid

N = 40


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds")
    list(CacheDataLoader(DictDataset(N), cache_dir=path, chunk_size=4, batch_size=8))
    return path


def keys(batches) -> list[int]:
    return torch.cat([b["i"] for b in batches]).tolist()


def test_cache_dataloader_is_a_torch_dataloader(written):
    ds = StreamingDataset(written)
    dl = CacheDataLoader(ds, batch_size=8, num_workers=1, pin_memory=False)
    assert isinstance(dl, DataLoader)
    assert (dl.dataset, dl.batch_size, dl.num_workers, dl.drop_last) == (ds, 8, 1, False)
    assert len(dl) == N // 8 and sorted(keys(dl)) == list(range(N))


def test_persistent_workers_keep_their_processes_and_get_each_epochs_plan(written):
    def run(persistent: bool, epochs: int) -> tuple[list[list[int]], list[set[int]]]:
        ds = StreamingDataset(written, shuffle=True, seed=5, transform=key_and_pid)
        dl = CacheDataLoader(
            ds,
            batch_size=4,
            num_workers=2,
            persistent_workers=persistent,
            multiprocessing_context="fork",
        )
        orders, pids = [], []
        for _ in range(epochs):
            batches = list(dl)
            orders.append([k for b in batches for k in b[0].tolist()])
            pids.append({p for b in batches for p in b[1].tolist()})
        return orders, pids

    orders, pids = run(True, 3)
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2], "same worker processes"
    reference, fresh = run(False, 3)
    assert fresh[0].isdisjoint(fresh[1]), "without persistence each epoch forks anew"
    assert orders == reference, "every epoch's plan reached the persistent workers"
    assert len({tuple(o) for o in orders}) == 3 and all(sorted(o) == list(range(N)) for o in orders)


def test_persistent_workers_resume_mid_epoch(written):
    def make() -> CacheDataLoader:
        ds = StreamingDataset(written, shuffle=True, seed=5)
        return CacheDataLoader(
            ds, batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
        )

    dl = make()
    whole = [keys(dl), keys(dl)]  # epochs 0 and 1
    dl = make()
    list(dl)  # epoch 0 through the persistent workers
    it = iter(dl)
    before = [next(it)["i"].tolist() for _ in range(3)]
    state = dl.state_dict()
    dl2 = make()
    list(dl2)  # its workers start (and run epoch 0) before the state arrives
    dl2.load_state_dict(state)
    after = keys(dl2)
    assert [k for b in before for k in b] + after == whole[1]


def test_each_iter_of_a_dataset_is_the_next_epoch(written):
    ds = StreamingDataset(written, shuffle=True, seed=7)
    direct = [[x["i"] for x in ds] for _ in range(3)]
    assert len({tuple(o) for o in direct}) == 3
    for e in range(3):
        pinned = StreamingDataset(written, shuffle=True, seed=7)
        pinned.set_epoch(e)
        assert [x["i"] for x in pinned] == direct[e], "deterministic from (seed, epoch)"
    ds.set_epoch(1)
    assert [x["i"] for x in ds] == direct[1], "set_epoch names the epoch the next iter runs"
    assert [x["i"] for x in ds] == direct[2], "then it advances again"


@pytest.mark.parametrize("persistent", [False, True])
def test_a_plain_dataloader_advances_the_epoch(written, persistent):
    def plain(ds):
        return DataLoader(
            ds,
            batch_size=4,
            num_workers=2,
            persistent_workers=persistent,
            multiprocessing_context="fork",
        )

    ds = StreamingDataset(written, shuffle=True, seed=7)
    dl = plain(ds)
    got = [keys(dl) for _ in range(3)]
    for e in range(3):
        pinned = StreamingDataset(written, shuffle=True, seed=7)
        pinned.set_epoch(e)
        assert keys(plain(pinned)) == got[e]
    assert len({tuple(o) for o in got}) == 3
    assert all(sorted(o) == list(range(N)) for o in got)


def test_epochs_advance_alike_on_every_rank(written, monkeypatch):
    seen: dict[int, list[list[int]]] = {}
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        ds = StreamingDataset(written, shuffle=True, seed=3)
        seen[rank] = [[x["i"] for x in ds] for _ in range(2)]
    for e in range(2):
        both = seen[0][e] + seen[1][e]
        assert sorted(both) == list(range(N)), f"epoch {e}: the ranks split the same order"
    assert seen[0][0] != seen[0][1]


def test_sizes_accept_what_the_environment_accepts(tmp_path):
    dl = CacheDataLoader(RandomDataset(64, 64), cache_dir=tmp_path / "a", chunk_bytes="8KiB")
    list(dl)
    assert dl.cache is not None and dl.cache.chunk_bytes == 8192
    assert len(Cache(tmp_path / "a").index.chunks) >= 2
    assert Cache(tmp_path / "b", chunk_bytes="64MB").chunk_bytes == 64 << 20
    assert Cache(tmp_path / "b", chunk_bytes=1 << 26).chunk_bytes == 64 << 20
    ds = StreamingDataset(tmp_path / "a", max_cache_bytes="50GB")
    assert ds.settings.max_cache_bytes == 50 << 30
    assert Cache(tmp_path / "a", max_cache_bytes="64MiB").max_cache_bytes == 64 << 20
    with pytest.raises(ConfigError, match="chunk_bytes must be a size"):
        Cache(tmp_path / "c", chunk_bytes="lots")
    with pytest.raises(ConfigError, match="max_cache_bytes must be a size"):
        StreamingDataset(tmp_path / "a", max_cache_bytes=[1])


def test_a_seed_the_dataset_would_ignore_raises(written):
    ds = StreamingDataset(written, shuffle=True, seed=3)
    with pytest.raises(ConfigError, match=r"seed=99 .*pass seed=99 to StreamingDataset"):
        CacheDataLoader(ds, seed=99)
    CacheDataLoader(ds, seed=3)  # the same seed is fine


def test_main_process_state_after_workers_consumed_raises(written):
    ds = StreamingDataset(written)
    it = iter(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork"))
    next(it)
    with pytest.raises(ResumeStateError, match=r"CacheDataLoader\.state_dict\(\)"):
        ds.state_dict()
    del it
    direct = StreamingDataset(written)
    it2 = iter(direct)
    first = [next(it2)["i"] for _ in range(5)]
    state = direct.state_dict()  # iterated here: its own count is right
    rest = StreamingDataset(written)
    rest.load_state_dict(state)
    assert first + [x["i"] for x in rest] == list(range(N))


def _iterate_twice(ds, out) -> None:
    out.put([[x["i"] for x in ds] for _ in range(2)])


def test_a_copy_in_another_process_counts_its_own_epochs(written):
    """Ranks started from one process (fork, mp.spawn, Lightning's ddp_spawn) each count
    their own iterations: they don't advance each other's epochs."""
    ds = StreamingDataset(written, shuffle=True, seed=7)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_iterate_twice, args=(ds, out)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
    mine = [[x["i"] for x in ds] for _ in range(2)]
    assert got[0] == got[1] == mine, "every process ran epochs 0 and 1"
