"""Index version 2 read for real: same epochs as version 1, mapped across fork and spawn,
fetched once per node, a damaged sidecar fetched again or refused, gloo ranks."""

from __future__ import annotations

import glob
import math
import mmap
import multiprocessing
import os
import shutil

import numpy as np
import pytest

from asynccache.cache.indexfile import read_dir
from asynccache.config import Settings
from asynccache.errors import AsyncCacheError
from asynccache.format import Index
from asynccache.read.source import DatasetSource
from asynccache.testing.faults import Fault, FaultProxy
from tests.remote_data import write_dataset

pytestmark = pytest.mark.timeout(120)

N, CHUNK = 61, 4


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same data with a version-2 index (as written) and a version-1 index."""
    root = tmp_path_factory.mktemp("both")
    v2 = write_dataset(root / "v2", N, chunk_size=CHUNK)
    v1 = root / "v1"
    shutil.copytree(v2, v1)
    for side in glob.glob(str(v1 / "index-*.cols")):
        os.unlink(side)
    (v1 / "index.json").write_text(read_dir(str(v2)).to_json())
    return v1, v2


def _settings(tmp_path, retries: int = 2) -> Settings:
    return Settings(
        cache_dir=str(tmp_path / "cc"), retries=retries, backoff_base_s=0.01, backoff_max_s=0.05
    )


def test_both_forms_give_identical_epochs_and_items(both, tmp_path) -> None:
    from asynccache import StreamingDataset

    v1, v2 = both
    got = {}
    for name, path in (("v1", v1), ("v2", v2)):
        ds = StreamingDataset(path, shuffle=True, seed=11, shuffle_window=2)
        assert ds.index.mapped == (name == "v2")
        epochs = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            epochs.append([(int(x["i"]), bytes(x["pad"])) for x in ds])
        got[name] = epochs
    assert got["v1"] == got["v2"]
    assert sorted(i for i, _ in got["v2"][0]) == list(range(N))
    assert got["v2"][0] != got["v2"][1]  # the epochs are shuffled differently


def _backing(arr: np.ndarray) -> object:
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    base = arr.base
    return base.obj if isinstance(base, memoryview) else base


def _probe(index: Index, out) -> None:
    keys = np.arange(index.total_items)
    chunks, pos = index.locate_many(keys)
    out.put(
        (
            index.mapped,
            isinstance(_backing(index.items_per_chunk), mmap.mmap),
            chunks.tolist(),
            pos.tolist(),
            [c.filename for c in index.chunks],
        )
    )


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_mapped_index_survives_fork_and_spawn(both, method) -> None:
    index = read_dir(str(both[1]))
    assert isinstance(_backing(index.items_per_chunk), mmap.mmap)
    ctx = multiprocessing.get_context(method)
    out = ctx.Queue()
    child = ctx.Process(target=_probe, args=(index, out))
    child.start()
    try:
        mapped, shared, chunks, pos, names = out.get(timeout=60)
    finally:
        child.join(60)
    assert child.exitcode == 0
    # mapped again from the file in a spawned child (not a pickled copy of the arrays)
    assert mapped and shared
    want_c, want_p = index.locate_many(np.arange(N))
    assert chunks == want_c.tolist() and pos == want_p.tolist()
    assert names == [f"chunk-0-{i}.bin" for i in range(math.ceil(N / CHUNK))]


def _open_remote(url: str, settings: Settings, out) -> None:
    try:
        src = DatasetSource(url, settings=settings)
        out.put(("ok", src.index.total_items, src.index.mapped))
        src.close()
    except BaseException as exc:  # relayed to the test
        out.put(("error", repr(exc), False))


def test_sidecar_is_fetched_once_by_processes_opening_at_once(both, tmp_path, http_origin):
    server = http_origin(both[1])
    settings = _settings(tmp_path)
    with FaultProxy(server.url) as proxy:
        # slow, so that the other processes ask while the first download runs
        proxy.add_fault(Fault("slow", path=".cols", after_bytes=10, stall_s=1.0))
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_open_remote, args=(proxy.url, settings, out)) for _ in range(3)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=90) for _ in procs]
        for p in procs:
            p.join(30)
        assert results == [("ok", N, True)] * 3, results
        assert proxy.fired("slow") == 1
        assert proxy.count("GET", ".cols") == 1  # one GET for the node
        assert proxy.count("GET", "index.json") == 3  # the small index.json: one each


def test_sidecar_damaged_in_transit_is_fetched_again(both, tmp_path, http_origin) -> None:
    server = http_origin(both[1])
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", path=".cols", flip_at=200, flip_xor=1))
        src = DatasetSource(proxy.url, settings=_settings(tmp_path))
        assert proxy.fired("flip") == 1
        assert proxy.count("GET", ".cols") == 2
        assert src.index.mapped and src.index.total_items == N
        src.close()


def test_sidecar_damaged_every_time_is_refused_naming_it(both, tmp_path, http_origin) -> None:
    server = http_origin(both[1])
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", times=100, path=".cols", flip_at=200, flip_xor=1))
        with pytest.raises(AsyncCacheError, match=r"index-[0-9a-f]{16}\.cols"):
            DatasetSource(proxy.url, settings=_settings(tmp_path, retries=1))
        assert proxy.fired("flip") >= 2


def test_sidecar_damaged_in_the_cache_is_fetched_again(both, tmp_path, http_origin) -> None:
    server = http_origin(both[1])
    with FaultProxy(server.url) as proxy:
        DatasetSource(proxy.url, settings=_settings(tmp_path)).close()
        (cached,) = glob.glob(str(tmp_path / "cc" / "**" / "index-*.cols"), recursive=True)
        with open(cached, "r+b") as f:  # bit rot on the local disk, same size
            f.seek(300)
            b = f.read(1)
            f.seek(300)
            f.write(bytes([b[0] ^ 0x04]))
        src = DatasetSource(proxy.url, settings=_settings(tmp_path))
        assert src.index.total_items == N
        assert proxy.count("GET", ".cols") == 2  # the damaged copy was replaced
        src.close()


def test_reindex_turns_a_version_1_dataset_into_version_2(both, tmp_path, capsys) -> None:
    from asynccache.cli import main

    d = tmp_path / "ds"
    shutil.copytree(both[0], d)
    before = read_dir(str(d))
    assert not before.mapped
    assert main(["reindex", str(d)]) == 0
    assert "version 1 -> 2" in capsys.readouterr().out
    after = read_dir(str(d))
    assert after.mapped and list(after.chunks) == list(before.chunks)
    assert main(["reindex", str(d)]) == 0
    assert "already version 2" in capsys.readouterr().out
    assert main(["verify", str(d)]) == 0  # every chunk still matches the new index
