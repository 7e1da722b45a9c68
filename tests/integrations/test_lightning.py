"""Lightning end to end: Trainer.fit with 2-process gloo DDP on CPU over a StreamingDataset
from the S3 server; stopped mid-epoch at a checkpoint, resumed with ckpt_path through
Lightning's own stateful-loader mechanism; both runs together see exactly one epoch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from asynccache import CacheDataLoader
from asynccache.config import Settings
from asynccache.write.upload import upload
from tests.loader.datasets import DictDataset

pytest.importorskip("lightning")

N, B, STOP = 48, 4, 2  # 24 samples, 6 batches per rank; stop after 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fit_stopped_mid_epoch_and_resumed_sees_exactly_one_epoch(objstore, bucket, tmp_path):
    src = tmp_path / "src"
    list(CacheDataLoader(DictDataset(N), cache_dir=src, chunk_size=6, batch_size=8))
    url = f"s3://{bucket}/ds"
    upload(src, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    out = tmp_path / "out"
    out.mkdir()
    cfg = {
        "url": url,
        "storage_options": objstore.storage_options,
        "out": str(out),
        "batch_size": B,
        "stop": STOP,
    }
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            PYTHONPATH=ROOT,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.integrations.lightning_job", json.dumps(cfg)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=200)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]

    def seen(run: int, rank: int) -> list[int]:
        return json.loads((out / f"run{run}-rank{rank}.json").read_text())

    for rank in range(2):
        assert len(seen(1, rank)) == STOP * B, "run 1 stopped mid-epoch"
        assert len(seen(2, rank)) == N // 2 - STOP * B, "run 2 ran only the rest"
    both = [k for run in (1, 2) for rank in range(2) for k in seen(run, rank)]
    assert sorted(both) == list(range(N)), "the two runs together: exactly one epoch"
    ckpt = torch.load(out / "ckpt" / "mid.ckpt", weights_only=False)
    states = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert states[0]["batches"] == STOP, "Lightning saved the loader's own state"
