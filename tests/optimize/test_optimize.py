"""optimize(): local and S3 outputs, modes, input errors, compact index (real SeaweedFS)."""

from __future__ import annotations

import json
import os
import random

import pytest

from asynccache import ConfigError, DatasetExistsError, InputFailedError, StreamingDataset, optimize
from asynccache.config import Settings
from asynccache.format.columns import sidecar_name
from asynccache.optimize.job import WORK_PREFIX
from tests.optimize import helpers

QUIET = Settings.from_env(progress=False)


def committed(index):
    """What a commit leaves in the output: index.json, its column sidecar, the chunks."""
    return ["index.json", sidecar_name(index.checksum.split(":")[1])] + [
        c.filename for c in index.chunks
    ]


def read_all(url: str, cache_dir: str, storage_options=None) -> list[dict]:
    ds = StreamingDataset(url, cache_dir=cache_dir, storage_options=storage_options)
    try:
        return [ds[k] for k in range(len(ds))]
    finally:
        ds.close()


def listing(objstore, bucket: str, prefix: str = "") -> list[str]:
    from asynccache.optimize.job import call
    from asynccache.storage import open_storage

    storage = open_storage(f"s3://{bucket}/{prefix}", QUIET, objstore.storage_options)
    try:
        return [o.key for o in call(storage.list())]
    finally:
        call(storage.close())


def test_s3_two_workers_each_output_once_in_input_order(objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    inputs = list(range(120))
    staging = tmp_path / "staging"
    staging.mkdir()
    res = optimize(
        helpers.items, inputs, url, num_workers=2, chunk_bytes="2KB",
        storage_options=objstore.storage_options, staging_dir=str(staging), settings=QUIET,
    )  # fmt: skip
    got = [
        (int(x["i"]), int(x["j"])) for x in read_all(url, tmp_path / "c", objstore.storage_options)
    ]
    assert got == helpers.expected(inputs)
    assert res.items == len(got) and res.inputs == 120
    assert all(len(c.keys) == 1 for c in res.index.chunks)  # one key run per chunk
    keys = listing(objstore, bucket, "ds")
    assert not [k for k in keys if k.startswith(WORK_PREFIX)], keys  # no job files left
    assert sorted(keys) == sorted(committed(res.index))
    assert os.listdir(staging) == []  # staged chunks were deleted after upload


def test_local_output_works_the_same(tmp_path):
    out = str(tmp_path / "out")
    inputs = list(range(60))
    res = optimize(helpers.items, inputs, out, num_workers=0, chunk_bytes="1KB", settings=QUIET)
    got = [(int(x["i"]), int(x["j"])) for x in read_all(out, tmp_path / "c")]
    assert got == helpers.expected(inputs)
    assert sorted(os.listdir(out)) == sorted(committed(res.index))


def test_create_refuses_an_existing_dataset(tmp_path):
    out = str(tmp_path / "out")
    optimize(helpers.tag, [("a", i) for i in range(5)], out, num_workers=0, settings=QUIET)
    with pytest.raises(DatasetExistsError, match="mode='overwrite'"):
        optimize(helpers.tag, [("b", i) for i in range(5)], out, num_workers=0, settings=QUIET)


def test_overwrite_never_mixes_and_a_failed_overwrite_keeps_the_old(objstore, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    so = objstore.storage_options
    old = optimize(
        helpers.tag, [("a", i) for i in range(40)], url, num_workers=0, chunk_bytes="512B",
        storage_options=so, settings=QUIET,
    )  # fmt: skip
    # An overwrite whose fn fails halfway: the old dataset stays whole, no new chunk stays.
    with pytest.raises(InputFailedError, match="input #7"):
        optimize(helpers.bad_on_7, list(range(20)), url, num_workers=0, chunk_bytes="512B",
                 mode="overwrite", storage_options=so, settings=QUIET)  # fmt: skip
    assert sorted(listing(objstore, bucket, "ds")) == sorted(committed(old.index))
    assert {x["name"] for x in read_all(url, tmp_path / "c1", so)} == {"a"}
    new = optimize(
        helpers.tag, [("b", i) for i in range(30)], url, num_workers=0, chunk_bytes="512B",
        mode="overwrite", storage_options=so, settings=QUIET,
    )  # fmt: skip
    old_names = {c.filename for c in old.index.chunks}
    assert old_names.isdisjoint(c.filename for c in new.index.chunks)  # new names per job
    assert sorted(listing(objstore, bucket, "ds")) == sorted(committed(new.index))
    got = read_all(url, tmp_path / "c2", so)
    assert [(x["name"], int(x["i"])) for x in got] == [("b", i) for i in range(30)]


def test_append_adds_after_and_changes_identity(tmp_path):
    out = str(tmp_path / "out")
    first = optimize(helpers.tag, [("a", i) for i in range(10)], out, num_workers=0, settings=QUIET)
    second = optimize(
        helpers.tag, [("b", i) for i in range(5)], out, num_workers=0, mode="append", settings=QUIET
    )
    assert second.index.checksum != first.index.checksum
    assert second.index.chunks[: len(first.index.chunks)] == first.index.chunks
    got = [(x["name"], int(x["i"])) for x in read_all(out, tmp_path / "c")]
    assert got == [("a", i) for i in range(10)] + [("b", i) for i in range(5)]


def test_fn_raising_names_the_input_and_cleans_up(objstore, bucket):
    url = f"s3://{bucket}/ds"
    with pytest.raises(InputFailedError, match=r"input #7 \(7\): ValueError: cannot decode"):
        optimize(helpers.bad_on_7, list(range(20)), url, num_workers=1, chunk_bytes="256B",
                 storage_options=objstore.storage_options, settings=QUIET)  # fmt: skip
    assert listing(objstore, bucket, "ds") == []  # chunks, shard indexes, plan, lease: gone


def test_on_error_skip_counts_and_drops_every_item_of_the_input(tmp_path):
    out = str(tmp_path / "out")
    res = optimize(helpers.bad_midway, list(range(10)), out, num_workers=0, on_error="skip",
                   chunk_bytes="256B", settings=QUIET)  # fmt: skip
    assert res.skipped == 1 and "input #5" in res.errors[0] and "broken halfway" in res.errors[0]
    got = [int(x["i"]) for x in read_all(out, tmp_path / "c")]
    assert got == [i for i in range(10) if i != 5 for _ in range(2)]


def test_unpicklable_fn_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="module level"):
        optimize(lambda x: x, [1, 2], str(out), num_workers=1, settings=QUIET)
    assert not out.exists()


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ConfigError, match="mode"):
        optimize(helpers.items, [1], str(tmp_path), mode="replace", settings=QUIET)
    with pytest.raises(ConfigError, match="on_error"):
        optimize(helpers.items, [1], str(tmp_path), on_error="ignore", settings=QUIET)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        optimize(helpers.items, [1], str(tmp_path), chunk_bytes="lots", settings=QUIET)


# Tiny items whose inputs arrive shuffled: index.json stays O(chunks), one key run per
# chunk (shard-local keys, shifted at the merge). The 100k-item case of the writer that
# gets keys in a shuffled order is in tests/format/test_compact_index.py.
INDEX_LIMIT = 4 << 10  # bytes; one run per item would be ~31 bytes x 20k = 600 KB


def test_index_stays_compact_for_shuffled_inputs(tmp_path):
    inputs = list(range(20_000))
    random.Random(0).shuffle(inputs)
    out = str(tmp_path / "out")
    res = optimize(helpers.small, inputs, out, num_workers=0, chunk_bytes="256KB", settings=QUIET)
    size = os.path.getsize(os.path.join(out, "index.json"))
    assert res.index.total_items == 20_000
    assert size < INDEX_LIMIT, size
    assert sum(len(c.keys) for c in res.index.chunks) == len(res.index.chunks)
    doc = json.load(open(os.path.join(out, "index.json")))
    assert doc["total_items"] == 20_000


def test_importing_asynccache_and_optimize_does_not_import_torch():
    """optimize's fork server imports these: torch would cost it seconds per job."""
    import subprocess
    import sys

    code = (
        "import sys, asynccache, asynccache.optimize\n"
        "print('torch' in sys.modules, 'StreamingDataset' in dir(asynccache))\n"
    )  # (tests/test_public_api.py resolves every lazy name)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_local_chunks_are_fsynced_before_a_shard_index_names_them(tmp_path, monkeypatch):
    """Chunks are renamed in unsynced; each shard index must come after their fsync."""
    from asynccache.optimize import job as jobmod
    from asynccache.optimize import shard as shardmod

    events: list[tuple[str, list[str]]] = []
    real_sync, real_put = shardmod.sync_files, jobmod._put_local

    def sync(paths):
        real_sync(paths)
        events.append(("fsync", [os.path.basename(p) for p in paths]))

    def put(path, data, durable):
        real_put(path, data, durable)
        if path.endswith(".index.json") and "/shard-" in path:
            events.append(("index", [c["filename"] for c in json.loads(data)["chunks"]]))

    monkeypatch.setattr(shardmod, "sync_files", sync)
    monkeypatch.setattr(jobmod, "_put_local", put)
    out = str(tmp_path / "out")
    optimize(helpers.items, list(range(60)), out, num_workers=0, num_shards=3,
             chunk_bytes="1KB", settings=QUIET)  # fmt: skip
    indexes = [names for kind, names in events if kind == "index"]
    assert len(indexes) == 3 and all(indexes)  # the property below is not vacuous
    synced: set[str] = set()
    for kind, names in events:
        if kind == "fsync":
            synced.update(names)
        else:
            assert set(names) <= synced, f"a shard index named unsynced chunks {names}"


def test_pool_context_keeps_the_preload_list_it_finds(monkeypatch):
    """The process has one fork server; optimize adds its modules to what the caller asked it
    to preload instead of replacing that list (a caller's own preload of, e.g., torch would be
    lost otherwise, and its forked processes would each import it)."""
    import multiprocessing
    from multiprocessing import forkserver

    from asynccache.optimize.api import _PRELOAD, pool_context

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver start method on this platform")
    server = forkserver._forkserver
    monkeypatch.setattr(server, "_preload_modules", list(server._preload_modules))
    multiprocessing.set_forkserver_preload(["json", "asynccache.optimize.api"])
    pool_context()
    pool_context()
    kept = list(server._preload_modules)
    assert kept[:2] == ["json", "asynccache.optimize.api"]
    assert all(m in kept for m in _PRELOAD)
    assert len(kept) == len(set(kept)), kept
