"""What each rank of a spawned gloo group runs for the optimize scale-out test."""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

from asynccache import AsyncCacheError, optimize
from asynccache.config import Settings
from tests.optimize import helpers


def rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """Convert ``cfg["n"]`` inputs into ``cfg["url"]`` as rank ``rank``, staging in its own dir."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        own = cfg["node_dirs"][rank]  # this "node"'s private disk: nothing else is shared
        fn = getattr(helpers, cfg.get("fn", "items"))
        try:
            res = optimize(
                fn,
                list(range(cfg["n"])),
                cfg["url"],
                num_workers=cfg["workers"],
                chunk_bytes=2048,
                storage_options=cfg["storage_options"],
                staging_dir=own,
                settings=Settings.from_env(progress=False),
            )
        except AsyncCacheError as exc:
            doc = {"error": str(exc), "type": type(exc).__name__}
            doc["staged_left"] = sorted(os.listdir(own))  # (before result.json is made)
            with open(os.path.join(own, "result.json"), "w") as f:
                json.dump(doc, f)
            return
        out = {
            "inputs": res.inputs,
            "generation": res.index.config["generation"],
            "staged_left": sorted(os.listdir(own)),
        }
        with open(os.path.join(own, "result.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()
