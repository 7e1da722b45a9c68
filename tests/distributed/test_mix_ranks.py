"""A per_stream mix saved by one process and resumed by two gloo ranks (one launch):
nothing lost or repeated but the padding, batches still pure, chunks fetched once per node."""

from __future__ import annotations

import collections
import os
import pickle

import pytest

from asynccache.optimize.api import pool_context
from tests.distributed.mix_ranks import build, mix_rank_main
from tests.distributed.test_ddp import launch
from tests.loader.mix_data import CHUNK, SIZES, WEIGHTS, upload_streams, write_streams

pytestmark = pytest.mark.timeout(300)
B = 8


def test_mix_resumes_from_one_process_on_two_ranks(objstore, tmp_path):
    bucket = "mixr-" + os.urandom(4).hex()
    objstore.create_bucket(bucket)
    urls = upload_streams(objstore, write_streams(str(tmp_path / "src")), bucket)
    cfg = {
        "urls": urls,
        "weights": list(WEIGHTS),
        "storage_options": objstore.storage_options,
        "cache_dir": str(tmp_path / "cache-one"),
        "batch_size": B,
        "num_workers": 0,
        "out": str(tmp_path / "out"),
        "state": str(tmp_path / "state.pkl"),
    }
    whole = [
        tuple(p) for b in build(cfg) for p in zip(b["s"].tolist(), b["i"].tolist(), strict=True)
    ]
    dl = build(cfg)
    it = iter(dl)
    first = [next(it) for _ in range(9)]
    before = [p for b in first for p in zip(b["s"].tolist(), b["i"].tolist(), strict=True)]
    with open(cfg["state"], "wb") as f:
        pickle.dump(dl.state_dict(), f)
    del it
    # ranks fork from a server that preloaded torch.distributed (not a spawn apiece)
    ctx = pool_context()  # its preload list (tests/conftest.py) names tests.distributed.mix_ranks
    ranks = launch(
        2,
        dict(cfg, num_workers=0, cache_dir=str(tmp_path / "cache-ranks")),
        main=mix_rank_main,
        start_method=ctx.get_start_method(),
    )
    batches = [[tuple(p) for p in b] for r in ranks for b in r[0]["batches"]]
    assert len({len(r[0]["batches"]) for r in ranks}) == 1, "every rank takes as many batches"
    assert all(len({s for s, _ in b}) == 1 and len(b) == B for b in batches), "pure batches"
    after = [p for b in batches for p in b]
    want = collections.Counter(whole)
    got = collections.Counter(before) + collections.Counter(after)
    assert not want - got, "nothing missed"
    extra = got - want
    assert sum(extra.values()) < 2 * B, "repeats only from padding two ranks"
    chunks = sum(-(-n // CHUNK) for n in SIZES)
    fetched = sum(r[0]["fetched"] for r in ranks)
    # each chunk at most once for the node (plus an index sidecar per stream and rank,
    # where the index form has one)
    assert fetched <= chunks + 2 * len(SIZES)
