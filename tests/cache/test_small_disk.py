"""A cache on a file system smaller than the dataset (issue "trust, second round", item 8),
on a real 10 MiB tmpfs: what is taken ahead of need gives way to what a reader waits for,
and only a disk that cannot hold what the readers read at once fails, before its epoch.

The bodies run with the tmpfs mounted (see :mod:`small_fs`); what they read comes from the
real S3 server, named in ``args.json`` beside the mount point.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from small_fs import on_small_fs

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.cache import ChunkStore, dataset_dir, usage
from asynccache.cache.plan import Deferred
from asynccache.config import Settings
from asynccache.errors import DiskFullError
from asynccache.write.upload import upload
from asynccache.write.writer import ChunkWriter, merge_dir

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
ITEMS = 384  # 24 chunks of about 1 MiB: 2.3 times the file system
RUNS = 5


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    w = ChunkWriter(str(src), 0, chunk_bytes=MiB)
    for i in range(ITEMS):
        w.add(i, {"i": i, "x": np.full(60_000, i % 251, dtype=np.uint8)})
    w.finish()
    index = merge_dir(str(src), [0])
    assert len(index.chunks) >= 20 and max(c.bytes for c in index.chunks) <= MiB
    bucket = f"small-{np.random.default_rng().integers(1 << 40):x}"
    objstore.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    upload(src, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    yield url
    objstore.delete_bucket(bucket)


def _args(mnt: Path) -> dict:
    return json.loads((mnt.parent / "args.json").read_text())


def _with_args(tmp_path: Path, **args: object) -> None:
    (tmp_path / "args.json").write_text(json.dumps(args))


def reads_every_run(mnt: Path) -> None:
    a = _args(mnt)
    for run in range(RUNS):
        cache = mnt / f"cache-{run}"
        ds = StreamingDataset(
            a["url"],
            cache_dir=cache,
            storage_options=a["opts"],
            shuffle=True,
            shuffle_window=2,
            seed=run,
        )
        loader = CacheDataLoader(ds, batch_size=8, num_workers=2)
        got = torch.cat([b["i"] for b in loader]).tolist()
        assert sorted(got) == list(range(ITEMS)), f"run {run}"
        ds.close()
        shutil.rmtree(cache)  # the next run starts on an empty disk again


def test_a_small_disk_reads_every_item_in_every_run(remote, objstore, tmp_path) -> None:
    _with_args(tmp_path, url=remote, opts=objstore.storage_options)
    on_small_fs(reads_every_run, tmp_path, size="10m")


def too_small_for_the_plan(mnt: Path) -> None:
    a = _args(mnt)
    cache = mnt / "cache"
    ds = StreamingDataset(
        a["url"], cache_dir=cache, storage_options=a["opts"], shuffle=True, shuffle_window=8
    )
    # Six readers hold 12 chunks of 1 MiB at once at least (a smaller shuffle window fits
    # a disk that holds more than that: tests/test_budget_warm.py).
    loader = CacheDataLoader(ds, batch_size=8, num_workers=6)
    with pytest.raises(DiskFullError, match="less than the") as info:
        list(loader)
    assert str(cache) in str(info.value) and "6 readers" in str(info.value)
    assert not list(cache.rglob("chunk-*.bin"))  # refused before the epoch read a chunk
    ds.close()


def test_a_disk_smaller_than_the_plan_fails_before_the_epoch(remote, objstore, tmp_path) -> None:
    _with_args(tmp_path, url=remote, opts=objstore.storage_options)
    on_small_fs(too_small_for_the_plan, tmp_path, size="10m")


def _made_ahead(store: ChunkStore, names: list[str], size: int) -> list[str]:
    return [n for n in names if asyncio.run(store.reserve_ahead(n, size))]


def _pin_new(store: ChunkStore, name: str, size: int) -> None:
    tmp = asyncio.run(store.reserve(name, size))
    tmp.pwrite(b"p" * size, 0)
    tmp.publish()
    assert store.pin(name)


def ahead_gives_way(mnt: Path) -> None:
    cache = mnt / "cache"
    here = ChunkStore(dataset_dir(cache, "s3://b/ds", "v1"), max_cache_bytes=1 << 40)
    other = ChunkStore(dataset_dir(cache, "s3://b/ds", "v1"), max_cache_bytes=1 << 40)
    size = MiB
    for i in range(3):
        _pin_new(here, f"chunk-2-{i}.bin", size)
    # Files made ahead of their downloads, by two stores (as two processes would); each
    # leaves room for a download beside it...
    assert len(_made_ahead(other, ["chunk-1-0.bin", "chunk-1-1.bin"], size)) == 2
    assert _made_ahead(here, [f"chunk-0-{i}.bin" for i in range(10)], size)
    # ... which a pinned chunk then takes.
    while usage.fs_free(cache) >= size + (64 << 10):
        _pin_new(here, f"chunk-2-{len(here.pinned())}.bin", size)
    assert usage.fs_free(cache) < size
    # A download a reader waits for: what this process made ahead gives way, and it fits.
    tmp = asyncio.run(here.reserve("chunk-9-9.bin", size))
    tmp.discard()
    assert not here.ready_ahead()
    assert here.pressed()  # and every process of the node is told:
    assert other.ready_ahead()
    assert not asyncio.run(other.reserve_ahead("chunk-1-9.bin", size))
    assert not other.ready_ahead()  # what it made ahead goes, nothing more is made
    with pytest.raises(Deferred):  # and its prefetches wait
        asyncio.run(other.reserve("chunk-1-8.bin", size, ahead=True))
    assert not [p for p in cache.rglob("*.tmp")]
    here.close()
    other.close()


def test_files_made_ahead_give_way_to_a_download_a_reader_waits_for(tmp_path) -> None:
    on_small_fs(ahead_gives_way, tmp_path, size="10m")


def only_pins_left(mnt: Path) -> None:
    store = ChunkStore(dataset_dir(mnt / "cache", "s3://b/ds", "v1"), max_cache_bytes=1 << 40)
    for i in range(12):
        try:
            tmp = asyncio.run(store.reserve(f"chunk-0-{i}.bin", MiB))
        except DiskFullError as exc:
            message = str(exc)
            break
        tmp.pwrite(b"p" * MiB, 0)
        tmp.publish()
        assert store.pin(f"chunk-0-{i}.bin")
    else:
        raise AssertionError("a 10 MiB disk took 12 MiB")
    # Nothing can be freed: the error comes at once and says what holds the disk.
    assert str(store.root) in message
    assert "pinned by this process" in message and "downloads in flight: 0" in message
    store.close()


def test_a_disk_full_of_pins_says_what_holds_it(tmp_path) -> None:
    on_small_fs(only_pins_left, tmp_path, size="10m")
