"""Four real gloo ranks, 2 data-parallel x 2 tensor-parallel, streaming from SeaweedFS,
the split named three ways (``data_parallel=(dp_rank, dp_size)``, ``replication=2``, an
explicit DP process group):

* the ranks of a tensor-parallel group get identical batches, in the same order, and save
  equal states; the DP groups' batches are disjoint and cover every sample once an epoch;
* stopped mid-epoch, each rank resumes in a fresh process from the state its
  tensor-parallel peer saved, exactly as the uninterrupted run continued;
* the node's cache serves the four ranks as two readers: a budget at the minimum of two
  readers streams (the minimum of four ranks is larger), and each chunk is fetched once.
"""

from __future__ import annotations

import os
import pickle
import re

import pytest

from asynccache import CacheDataLoader, ConfigError, StreamingDataset
from asynccache.optimize.api import pool_context
from asynccache.read.readplan import EpochSpec, ReaderPlace, plan_minimum
from tests.distributed.dp_ranks import WAYS, dp_rank_main
from tests.distributed.test_ddp import launch
from tests.loader.test_resume_property import as_rank
from tests.remote_data import upload_dataset, write_dataset

N, CHUNK, B, STOP = 48, 6, 4, 3
pytestmark = pytest.mark.timeout(400)


def two_reader_minimum(url: str, opts: dict, cache: str) -> int:
    """The cache budget minimum of two readers of this dataset (one per DP rank)."""
    with as_rank(0, 2), pytest.raises(ConfigError, match="below the minimum") as err:
        ds = StreamingDataset(
            url, cache_dir=cache, storage_options=opts, shuffle=True, seed=3, max_cache_bytes=1
        )
        next(iter(CacheDataLoader(ds, batch_size=B)))
    m = re.search(r"minimum of (\d+) bytes .* for 2 readers", str(err.value))
    assert m is not None, str(err.value)
    # The refusal names the least budget (two chunks per reader); the plan's own minimum
    # for the whole shuffle window, at which each chunk comes once, is at least that.
    place = ReaderPlace(0, (), 0, 2, 0, 1, 0, B, False)
    full = plan_minimum(ds.index, EpochSpec(place, ds.order_spec), ds.order_spec.window)
    assert full >= int(m.group(1))
    return full


def test_two_dp_by_two_tp_ranks(objstore, bucket, tmp_path):
    src = write_dataset(tmp_path / "src", N, chunk_size=CHUNK, pad=2048)
    url = upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)
    cache = str(tmp_path / "cache")
    cfg = {
        "url": url,
        "storage_options": objstore.storage_options,
        "cache_dir": cache,
        "batch_size": B,
        "stop": STOP,
        "budget": two_reader_minimum(url, objstore.storage_options, str(tmp_path / "probe")),
        "out": str(tmp_path / "out"),
    }
    ctx = pool_context()  # ranks fork from a server that preloaded torch.distributed
    first = [r[0] for r in launch(4, dict(cfg, phase="first"), main=dp_rank_main,
                                  start_method=ctx.get_start_method())]  # fmt: skip
    later = [r[0] for r in launch(4, dict(cfg, phase="resume"), main=dp_rank_main,
                                  start_method=ctx.get_start_method())]  # fmt: skip
    for way in WAYS:
        got = [r[way] for r in first]
        assert [g["dp"] for g in got] == [[0, 2], [0, 2], [1, 2], [1, 2]], way
        assert all(g["len"] == N // 2 // B for g in got), "batches per DP rank"
        assert got[0]["epochs"] == got[1]["epochs"], f"{way}: TP peers, identical batches"
        assert got[2]["epochs"] == got[3]["epochs"], way
        for epoch in range(2):
            a = [k for b in got[0]["epochs"][epoch] for k in b]
            b = [k for b in got[2]["epochs"][epoch] for k in b]
            assert sorted(a + b) == list(range(N)), f"{way}: every sample once, epoch {epoch}"
        states = []
        for rank in range(4):
            with open(os.path.join(cfg["out"], f"state-{way}-{rank}.pkl"), "rb") as f:
                states.append(pickle.load(f))
        assert states[0] == states[1] and states[2] == states[3], f"{way}: equal states"
        for rank in range(4):
            whole = [b for e in got[rank]["epochs"] for b in e]
            resumed = got[rank]["head"] + later[rank][way]["rest"]
            assert resumed == whole, f"{way}: rank {rank} resumed from its peer's state"
    fetched = sum(r["pair"]["fetched"] for r in first)
    # each chunk once for the node (and, where the index has one, its column sidecar
    # once per rank)
    assert fetched <= N // CHUNK + 4, fetched
