"""CacheDataLoader: epoch 1 writes, later epochs and processes read the same items."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from asynccache import Cache, CacheDataLoader, ConfigError
from tests.helpers import assert_same
from tests.loader.datasets import (
    DictDataset,
    ExplodingDataset,
    RandomDataset,
    SelfCachingDataset,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_beginner_snippet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dataset = RandomDataset(64, 64)
    dataloader = CacheDataLoader(dataset, cache_dir="./cache", chunk_bytes=2 << 12)
    batches = [batch for batch in dataloader]
    files = sorted(os.listdir("./cache"))
    assert files[0] == "0.index.json" and files[-1] == "index.json"
    chunks = [f for f in files if f.startswith("chunk-0-")]
    assert len(chunks) >= 2, "chunk_bytes=8192 must split 64 x 256-byte items"
    assert all(os.path.getsize(f"./cache/{c}") <= 2 << 12 for c in chunks)
    assert torch.equal(torch.cat(batches), dataset.data)


@pytest.mark.parametrize(
    ("num_workers", "context"), [(0, None), (1, "fork"), (2, "fork"), (2, "spawn")]
)
def test_write_then_read_equals_source_item_for_item(tmp_path, num_workers, context):
    ds = DictDataset(37)
    kw = {"multiprocessing_context": context} if context else {}
    dl = CacheDataLoader(
        ds, cache_dir=tmp_path, chunk_size=5, batch_size=4, num_workers=num_workers, **kw
    )
    expected = list(DataLoader(ds, batch_size=4))
    first = list(dl)
    assert (tmp_path / "index.json").exists()
    second = list(dl)
    assert len(first) == len(second) == len(expected) == len(dl)
    for a, b in zip(expected, first, strict=True):
        assert_same(a, b)  # the writing epoch keeps torch's batch order
    # Streamed epochs give each worker a contiguous run of the order, so with several
    # workers batches interleave; every item still arrives once, equal to the source.
    keys = torch.cat([b["i"] for b in second]).tolist()
    assert sorted(keys) == list(range(len(ds)))
    if num_workers <= 1:
        for a, c in zip(expected, second, strict=True):
            assert_same(a, c)
    for batch in second:
        for j, k in enumerate(batch["i"].tolist()):
            assert batch["name"][j] == f"item-{k}"
            assert torch.equal(batch["x"][j], torch.full((3,), float(k)))
            assert torch.equal(batch["t"][j], torch.tensor([k, -k]))
    writers = {
        f.split(".")[0]
        for f in os.listdir(tmp_path)
        if f.endswith(".index.json") and f != "index.json"
    }
    assert writers == {str(w) for w in range(max(1, num_workers))}
    cache = Cache(tmp_path)
    for i in range(len(ds)):
        assert_same(ds[i], cache[i])


def test_a_later_process_reads_the_cache_without_the_dataset(tmp_path):
    list(CacheDataLoader(DictDataset(20), cache_dir=tmp_path, chunk_size=3, batch_size=5))
    again = CacheDataLoader(ExplodingDataset(20), cache_dir=tmp_path, batch_size=5, num_workers=2)
    out = [b["i"] for b in again]
    assert sorted(torch.cat(out).tolist()) == list(range(20))
    from_path = CacheDataLoader(str(tmp_path), batch_size=20)
    assert torch.equal(next(iter(from_path))["i"], torch.arange(20))


def test_a_different_dataset_is_refused(tmp_path):
    list(CacheDataLoader(DictDataset(20), cache_dir=tmp_path, batch_size=5))
    with pytest.raises(ConfigError, match="20 items but the dataset has 21"):
        CacheDataLoader(DictDataset(21), cache_dir=tmp_path)


def test_shuffle_is_seeded_per_epoch_and_identical_when_writing(tmp_path):
    def orders(path, seed):
        dl = CacheDataLoader(
            DictDataset(40), cache_dir=path, shuffle=True, seed=seed, batch_size=8, num_workers=2
        )
        return [torch.cat([b["i"] for b in dl]).tolist() for _ in range(3)]

    a = orders(tmp_path / "a", 1)  # epoch 0 writes, 1-2 read
    b = orders(tmp_path / "b", 1)
    c = orders(tmp_path / "c", 2)
    assert a == b, "same seed, same orders (writing or reading)"
    assert a[0] != a[1] != a[2], "epochs differ"
    assert a[0] != c[0], "seeds differ"
    assert all(sorted(o) == list(range(40)) for o in a)
    dl = CacheDataLoader(
        DictDataset(40),
        cache_dir=tmp_path / "a",
        shuffle=True,
        seed=1,
        batch_size=8,
        num_workers=2,
    )
    dl.set_epoch(1)
    assert torch.cat([x["i"] for x in dl]).tolist() == a[1], "a new process replays epoch 1"


def test_drop_last_still_writes_every_item(tmp_path):
    dl = CacheDataLoader(
        DictDataset(10), cache_dir=tmp_path, batch_size=4, drop_last=True, num_workers=2
    )
    assert [len(b["i"]) for b in dl] == [4, 4]
    assert len(Cache(tmp_path)) == 10
    assert Cache(tmp_path)[9]["i"] == 9


def test_abandoned_first_epoch_is_redone_cleanly(tmp_path):
    dl = CacheDataLoader(
        DictDataset(30), cache_dir=tmp_path, chunk_size=2, batch_size=3, num_workers=2
    )
    it = iter(dl)
    next(it)
    next(it)
    del it
    assert not (tmp_path / "index.json").exists()
    out = torch.cat([b["i"] for b in dl])
    assert out.tolist() == list(range(30))
    assert len(Cache(tmp_path)) == 30


@pytest.mark.parametrize(("num_workers", "context"), [(0, None), (2, None), (2, "spawn")])
def test_dataset_that_fills_its_own_cache(tmp_path, num_workers, context):
    # spawn: the workers unpickle the dataset and its Cache, writing and then reading (the
    # documented example's default, examples/image_dataset.py, in one process)
    kw = {"multiprocessing_context": context} if context else {}
    dl = CacheDataLoader(
        SelfCachingDataset(str(tmp_path)), num_workers=num_workers, batch_size=4, **kw
    )
    first = torch.cat(list(dl)).tolist()
    assert (tmp_path / "index.json").exists()
    # A fresh process's view: the dataset now reads only from its cache.
    fresh = SelfCachingDataset(str(tmp_path))
    assert not hasattr(fresh, "data")
    second = torch.cat(
        list(CacheDataLoader(fresh, num_workers=num_workers, batch_size=4, **kw))
    ).tolist()
    assert first == second == list(range(30))


def test_cache_writes_in_any_order_and_reads_back_exactly(tmp_path):
    cache = Cache(tmp_path, chunk_size=3)
    order = [5, 0, 9, 2, 7, 1, 3, 8, 4, 6]
    for k in order:
        cache[k] = {"k": k, "t": torch.full((2,), k)}
    assert not cache.filled
    cache.done()
    assert cache.filled and len(cache) == 10
    for k in range(10):
        assert cache[k]["k"] == k and torch.equal(cache[k]["t"], torch.full((2,), k))
    idx = json.loads((tmp_path / "index.json").read_text())
    assert idx["total_items"] == 10 and "items" not in idx


def test_missing_cache_dir_is_a_config_error():
    with pytest.raises(ConfigError, match="cache_dir"):
        CacheDataLoader(DictDataset(3))


@pytest.mark.timeout(240)
def test_advanced_example_with_two_spawned_processes(tmp_path):
    # The spawned ranks' workers start from a fork server per rank (torch imported once per
    # rank, not by each worker of each epoch); they still unpickle the dataset and its Cache.
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "image_dataset.py"),
            "--cache-dir",
            str(tmp_path / "c"),
            "--workers-start",
            "forkserver",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("all ranks: 100 items") == 4, out.stdout
    files = set(os.listdir(tmp_path / "c"))
    assert {"0.index.json", "1.index.json", "2.index.json", "3.index.json", "index.json"} <= files
    assert len(Cache(tmp_path / "c")) == 100


def test_compressed_cache_round_trips_and_is_smaller(tmp_path):
    class Zeros(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return {"i": i, "x": torch.zeros(4096)}

    plain = list(CacheDataLoader(Zeros(), cache_dir=tmp_path / "p", batch_size=4))
    packed = list(
        CacheDataLoader(Zeros(), cache_dir=tmp_path / "z", batch_size=4, compression="zstd")
    )
    again = list(CacheDataLoader(Zeros(), cache_dir=tmp_path / "z", batch_size=4))
    for a, b, c in zip(plain, packed, again, strict=True):
        assert_same(a, b)
        assert_same(a, c)
    size = lambda d: sum(f.stat().st_size for f in d.glob("chunk-*.bin"))  # noqa: E731
    assert size(tmp_path / "z") < size(tmp_path / "p") / 5
    assert (
        json.loads((tmp_path / "z" / "index.json").read_text())["config"]["compression"] == "zstd"
    )


def test_rewriting_an_unfinished_cache_spares_other_files(tmp_path):
    (tmp_path / "notes.index.json").write_text("{}")
    (tmp_path / "chunk-final.bin").write_bytes(b"mine")
    (tmp_path / "7.index.json").write_text("{}")  # a stale writer index of ours
    list(CacheDataLoader(DictDataset(5), cache_dir=tmp_path, batch_size=2))
    assert (tmp_path / "notes.index.json").exists() and (tmp_path / "chunk-final.bin").exists()
    assert not (tmp_path / "7.index.json").exists()
    assert len(Cache(tmp_path)) == 5


def test_writing_into_a_filled_cache_is_refused(tmp_path):
    cache = Cache(tmp_path)
    cache[0] = 1
    cache.done()
    with pytest.raises(ConfigError, match="already filled"):
        Cache(tmp_path)[0] = 2
    assert Cache(tmp_path)[0] == 1
