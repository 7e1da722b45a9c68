"""What each rank of a spawned gloo group runs (importable, so spawn can find it)."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from typing import Any

import torch.distributed as dist

from asynccache import CacheDataLoader, StreamingDataset


def rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """Stream ``cfg["url"]``; write what this rank received per epoch to ``cfg["out"]``.

    ``cfg["workers_start"]``: how the DataLoader workers start (``"fork"``; default: as the
    rank's own default start method, which is how the rank itself was started)."""
    if cfg.get("workers_start") is None and multiprocessing.get_start_method() == "forkserver":
        # A rank started by a fork server starts its DataLoader workers the same way:
        # from its own fork server, which then imports torch once, not once per worker.
        multiprocessing.set_forkserver_preload(["tests.distributed.ranks"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        ds = StreamingDataset(
            cfg["url"],
            cache_dir=cfg["cache_dir"],
            shuffle=True,
            seed=cfg.get("seed", 7),
            storage_options=cfg["storage_options"],
        )
        dl = CacheDataLoader(
            ds,
            batch_size=cfg["batch_size"],
            num_workers=2,
            persistent_workers=cfg.get("persistent", False),
            multiprocessing_context=cfg.get("workers_start"),
        )
        if cfg.get("resume_from"):
            with open(cfg["resume_from"], "rb") as f:
                dl.load_state_dict(pickle.load(f))
        epochs = []
        for _ in range(cfg["epochs"]):
            keys = []
            for i, batch in enumerate(dl):
                keys += batch["i"].tolist()
                if cfg.get("stop_after") == i + 1:
                    if rank == 0:
                        with open(cfg["state_path"], "wb") as f:
                            pickle.dump(dl.state_dict(), f)
                    break
            epochs.append({"keys": keys, "len": len(dl)})
        dist.barrier()
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(epochs, f)
    finally:
        dist.destroy_process_group()
