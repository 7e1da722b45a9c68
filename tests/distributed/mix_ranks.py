"""What each rank of the mix's gloo launch runs (importable, so spawn can find it)."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch.distributed as dist

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.torch.mixed import MixedDataset, Stream


def build(cfg: dict[str, Any]) -> CacheDataLoader:
    """The per_stream mix of ``cfg["urls"]`` by ``cfg["weights"]``, in a loader."""
    streams = [
        Stream(
            StreamingDataset(
                u,
                cache_dir=cfg["cache_dir"],
                shuffle=True,
                seed=s,
                storage_options=cfg["storage_options"],
            ),
            weight=w,
        )
        for s, (u, w) in enumerate(zip(cfg["urls"], cfg["weights"], strict=True))
    ]
    ds = MixedDataset(streams, mode="per_stream", batch_size=cfg["batch_size"], seed=1)
    return CacheDataLoader(ds, batch_size=cfg["batch_size"], num_workers=cfg["num_workers"])


def mix_rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """Resume ``cfg["state"]`` and read the rest of the epoch; write what was received."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        dl = build(cfg)
        with open(cfg["state"], "rb") as f:
            dl.load_state_dict(pickle.load(f))
        batches = [list(zip(b["s"].tolist(), b["i"].tolist(), strict=True)) for b in dl]
        stats = dl.dataset.download_stats()
        dist.barrier()
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump([{"batches": batches, "fetched": stats["chunks_fetched"]}], f)
    finally:
        dist.destroy_process_group()
