"""Token blocks under a real gloo group: a world-2 state resumes on three ranks."""

from __future__ import annotations

import os
import pickle

import pytest

from asynccache.optimize.api import pool_context
from tests.distributed.test_ddp import launch

from .corpus import TOTAL, block_numbers
from .ranks import token_loader, token_rank_main
from .test_streaming_tokens import remote  # noqa: F401  (the S3 dataset fixture)

L, B = 300, 4
N_BLOCKS = TOTAL // L
pytestmark = pytest.mark.timeout(300)


def test_elastic_resume_from_two_ranks_to_three(remote, tmp_path, monkeypatch):  # noqa: F811
    url, opts = remote
    cfg = {
        "url": url, "storage_options": opts, "cache_dir": str(tmp_path / "cache"),
        "out": str(tmp_path / "post"), "block_size": L, "batch_size": B, "epochs": 2,
        "resume_from": str(tmp_path / "state.pkl"),
    }  # fmt: skip
    # Two ranks (RANK/WORLD_SIZE as a launcher sets them) each take 5 batches; every rank
    # of a DDP job consumes the same number, so rank 0's state is the job's.
    before: list[int] = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dl = token_loader(cfg)
        for i, batch in enumerate(dl):
            before += block_numbers(batch, L)
            if i + 1 == 5:
                break
        if rank == 0:
            with open(cfg["resume_from"], "wb") as f:
                pickle.dump(dl.state_dict(), f)
        del dl
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert len(before) == len(set(before)) == 2 * 5 * B
    # Ranks forked from optimize's fork server, which preloads torch.distributed and this
    # suite's rank module (tests/conftest.py names them): each rank starts warm.
    pool_context()
    post = launch(3, cfg, main=token_rank_main, start_method="forkserver")
    after = [k for r in post for k in r[0]["keys"]]
    assert not set(before) & set(after), "nothing repeated across the restart"
    assert set(before) | set(after) == set(range(N_BLOCKS)), "nothing missed"
    assert len(after) - len(set(after)) < 3, "at most the padding of three ranks"
    nxt = [k for r in post for k in r[1]["keys"]]
    assert set(nxt) == set(range(N_BLOCKS)), "the next epoch is whole again"
    assert os.path.exists(cfg["resume_from"])
