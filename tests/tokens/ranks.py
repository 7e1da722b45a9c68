"""What each rank of a spawned gloo group runs for the token tests (importable by spawn)."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch.distributed as dist

from asynccache import CacheDataLoader, StreamingDataset, TokenBlocks

from .corpus import block_numbers


def token_loader(cfg: dict[str, Any], workers: int = 2) -> CacheDataLoader:
    ds = StreamingDataset(
        cfg["url"],
        cache_dir=cfg["cache_dir"],
        shuffle=True,
        seed=11,
        shuffle_window=2,
        storage_options=cfg["storage_options"],
        item_loader=TokenBlocks(block_size=cfg["block_size"]),
    )
    return CacheDataLoader(ds, batch_size=cfg["batch_size"], num_workers=workers)


def token_rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """Resume from ``cfg["resume_from"]``; write the blocks each epoch gave to ``cfg["out"]``."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        # No DataLoader workers here: a spawned rank would spawn them too (seconds each on
        # a loaded box); the resume across worker counts is tested without gloo.
        dl = token_loader(cfg, workers=0)
        with open(cfg["resume_from"], "rb") as f:
            dl.load_state_dict(pickle.load(f))
        epochs = []
        for _ in range(cfg["epochs"]):
            blocks: list[int] = []
            for batch in dl:
                blocks += block_numbers(batch, cfg["block_size"])
            epochs.append({"keys": blocks})
        dist.barrier()
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(epochs, f)
    finally:
        dist.destroy_process_group()
