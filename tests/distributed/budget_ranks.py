"""What each rank of the cache-budget test runs (importable, so spawn can find it)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import urllib.error
import urllib.request
from typing import Any

import torch.distributed as dist

from asynccache import CacheDataLoader, StreamingDataset


def mark(proxy_url: str, name: str) -> None:
    """A request the proxy logs between two epochs (the store answers it with an error)."""
    with contextlib.suppress(urllib.error.URLError):
        urllib.request.urlopen(f"{proxy_url}/epoch-marker/{name}", timeout=10).close()


def budget_rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """For each (shuffle, budget): two epochs over a fresh cache dir shared by the ranks;
    after each, once every rank is done, rank 0 marks the proxy log."""
    if multiprocessing.get_start_method() == "forkserver":
        # its DataLoader workers come from the rank's own fork server: torch imported once
        multiprocessing.set_forkserver_preload(["tests.distributed.budget_ranks"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        out = []
        for shuffle, fraction in cfg["runs"]:
            ds = StreamingDataset(
                cfg["url"],
                cache_dir=os.path.join(cfg["cache_dir"], f"{int(shuffle)}-{fraction}"),
                shuffle=shuffle,
                seed=11,
                shuffle_window=cfg["window"],
                max_cache_bytes=int(cfg["total"] * fraction),
                storage_options=cfg["storage_options"],
            )
            dl = CacheDataLoader(ds, batch_size=cfg["batch_size"], num_workers=2)
            for epoch in range(2):
                keys = [k for batch in dl for k in batch["i"].tolist()]
                out.append(keys)
                dist.barrier()  # as a DDP step would keep them together
                if rank == 0:
                    mark(cfg["proxy"], f"{int(shuffle)}-{fraction}-{epoch}")
                dist.barrier()
            ds.close()
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def warm_rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """For each run of ``cfg["runs"]`` (shuffle, budget fraction, workers, persistent, a
    cache dir relative to the working directory or not): two epochs over a fresh cache
    dir shared by the ranks; after each, once every rank is done, rank 0 marks the proxy
    log. Writes each epoch's keys and the shuffle window read with."""
    if multiprocessing.get_start_method() == "forkserver":
        multiprocessing.set_forkserver_preload(["tests.distributed.budget_ranks"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        out = []
        for k, run in enumerate(cfg["runs"]):
            home = os.path.join(cfg["cache_dir"], f"run-{k}")
            os.makedirs(home, exist_ok=True)
            os.chdir(home)  # the ranks' own working directory (a relative cache dir)
            ds = StreamingDataset(
                cfg["url"],
                cache_dir="cache" if run["relative"] else os.path.join(home, "cache"),
                shuffle=run["shuffle"],
                seed=11,
                max_cache_bytes=int(cfg["total"] * run["fraction"]),
                storage_options=cfg["storage_options"],
            )
            kw = {"persistent_workers": True} if run["persistent"] and run["workers"] else {}
            dl = CacheDataLoader(ds, batch_size=cfg["batch_size"], num_workers=run["workers"], **kw)
            epochs = []
            for epoch in range(2):
                epochs.append([k for batch in dl for k in batch["i"].tolist()])
                dist.barrier()
                if rank == 0:
                    mark(cfg["proxy"], f"{k}-{epoch}")
                dist.barrier()
            out.append({"keys": epochs, "window": ds._order().spec.window})
            del dl
            ds.close()
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()
