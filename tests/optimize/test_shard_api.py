"""The per-shard API: start_job, write_shard on another engine, merge; resume via todo."""

from __future__ import annotations

import concurrent.futures

import pytest

from asynccache import ConfigError, StreamingDataset, WriteConflictError
from asynccache.config import Settings
from asynccache.optimize import start_job, write_shard
from tests.optimize import helpers

QUIET = Settings.from_env(progress=False)


def test_shards_run_on_an_engine_of_ours_then_a_rerun_does_only_the_rest(tmp_path):
    out = str(tmp_path / "out")
    inputs = list(range(50))
    with start_job(out, inputs, helpers.items, num_shards=5, chunk_bytes=1024,
                   settings=QUIET) as run:  # fmt: skip
        job = run.job
        assert run.todo == [0, 1, 2, 3, 4]
        # a second job is refused while this one holds the output
        with pytest.raises(WriteConflictError):
            start_job(out, inputs, helpers.items, num_shards=5, settings=QUIET)
        with concurrent.futures.ThreadPoolExecutor(2) as engine:  # "the engine"
            done = list(engine.map(
                lambda k: write_shard(job, helpers.items, inputs[slice(*job.bounds(k))], k),
                [0, 2],
            ))  # fmt: skip
        assert [r.shard for r in done] == [0, 2]
        with pytest.raises(ConfigError, match="shard 1 covers inputs"):
            write_shard(job, helpers.items, inputs[:3], 1)
    # the driver went away before the merge: the same arguments resume, shards 0 and 2 done
    with start_job(out, inputs, helpers.items, num_shards=5, chunk_bytes=1024,
                   settings=QUIET) as run:  # fmt: skip
        assert run.job.gen == job.gen and run.todo == [1, 3, 4]
        for k in run.todo:
            write_shard(run.job, helpers.items, inputs[slice(*run.job.bounds(k))], k)
        index = run.merge()
    ds = StreamingDataset(out, cache_dir=str(tmp_path / "c"))
    try:
        got = [(int(ds[k]["i"]), int(ds[k]["j"])) for k in range(len(ds))]
    finally:
        ds.close()
    assert got == helpers.expected(inputs) and index.total_items == len(got)
