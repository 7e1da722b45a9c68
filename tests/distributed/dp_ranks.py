"""What each rank of the data-parallel gloo launch runs (importable, so spawn can find it).

Four ranks: tensor-parallel groups ``{0, 1}`` and ``{2, 3}`` (the ranks of one model
replica), data-parallel rank ``rank // 2``. Each way of naming the split runs in turn:

* ``pair``: ``data_parallel=(rank // 2, 2)``;
* ``replication``: ``replication=2``;
* ``group``: ``data_parallel=`` this rank's DP process group (``{0, 2}`` or ``{1, 3}``).

``cfg["phase"] == "first"``: an uninterrupted run of two epochs, then a run stopped after
``stop`` batches whose state is saved; ``"resume"``: a fresh process loads the state its
tensor-parallel peer saved and reads to the end of epoch 1.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch.distributed as dist

from asynccache import CacheDataLoader, StreamingDataset

WAYS = ("pair", "replication", "group")


def _dataset(cfg: dict[str, Any], way: str, rank: int, groups: dict[int, Any]) -> Any:
    kw: dict[str, Any] = {}
    if way == "pair":
        kw["data_parallel"] = (rank // 2, 2)
    elif way == "replication":
        kw["replication"] = 2
    else:
        kw["data_parallel"] = groups[rank % 2]
    return StreamingDataset(
        cfg["url"],
        cache_dir=cfg["cache_dir"],
        storage_options=cfg["storage_options"],
        shuffle=True,
        seed=3,
        max_cache_bytes=cfg["budget"],
        **kw,
    )


def _loader(ds: Any, cfg: dict[str, Any], way: str) -> CacheDataLoader:
    if way == "pair":  # (the DP rank reaches a DataLoader worker too)
        return CacheDataLoader(
            ds, batch_size=cfg["batch_size"], num_workers=1, multiprocessing_context="fork"
        )
    return CacheDataLoader(ds, batch_size=cfg["batch_size"])


def _keys(batch: Any) -> list[int]:
    return [int(k) for k in batch["i"]]


def dp_rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        # Every rank takes part in making every group, in the same order.
        groups = {tp: dist.new_group([tp, tp + 2]) for tp in (0, 1)}
        out: dict[str, Any] = {}
        for way in WAYS:
            state_path = os.path.join(cfg["out"], f"state-{way}-{rank}.pkl")
            if cfg["phase"] == "first":
                ds = _dataset(cfg, way, rank, groups)
                dl = _loader(ds, cfg, way)
                epochs = [[_keys(b) for b in dl] for _ in range(2)]
                fetched = ds.download_stats()["chunks_fetched"]
                dl = _loader(_dataset(cfg, way, rank, groups), cfg, way)
                it = iter(dl)
                head = [_keys(next(it)) for _ in range(cfg["stop"])]
                with open(state_path, "wb") as f:
                    pickle.dump(dl.state_dict(), f)
                out[way] = {
                    "epochs": epochs,
                    "head": head,
                    "fetched": fetched,
                    "len": len(dl),
                    "dp": list(ds.dp_rank_and_world()),
                }
                del it
            else:
                peer = os.path.join(cfg["out"], f"state-{way}-{rank ^ 1}.pkl")
                with open(peer, "rb") as f:
                    state = pickle.load(f)
                dl = _loader(_dataset(cfg, way, rank, groups), cfg, way)
                dl.load_state_dict(state)
                out[way] = {"rest": [_keys(b) for b in dl] + [_keys(b) for b in dl]}
            dist.barrier()
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump([out], f)
    finally:
        dist.destroy_process_group()
