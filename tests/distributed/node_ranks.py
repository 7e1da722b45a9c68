"""What each rank of the two-node test runs (importable, so spawn can find it): four gloo
ranks launched as torchrun launches two nodes of two (``LOCAL_WORLD_SIZE=2``, ``LOCAL_RANK``),
each node with its own cache dir and its own counting proxy in front of the store."""

from __future__ import annotations

import json
import multiprocessing
import os
from typing import Any

import torch.distributed as dist

from asynccache import CacheDataLoader, ConfigError, StreamingDataset
from asynccache.torch import distributed
from asynccache.torch.streaming import reader_place
from tests.distributed.budget_ranks import mark

LOCAL = 2  # ranks per simulated node


def node_rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """Two epochs under ``cfg["budget"]`` on this rank's node (its cache dir, its proxy);
    after each, once every rank is done, rank 0 marks both proxies' logs. Writes each
    epoch's keys, the window read with, the plan's minimum, the node layout found from
    the hostnames, and the states a one-node layout saves."""
    if multiprocessing.get_start_method() == "forkserver":
        multiprocessing.set_forkserver_preload(["tests.distributed.node_ranks"])
    os.environ.update(LOCAL_WORLD_SIZE=str(LOCAL), LOCAL_RANK=str(rank % LOCAL))
    node = rank // LOCAL
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        opts = dict(cfg["storage_options"], endpoint_url=cfg["proxies"][node])

        def make(budget: int, cache: str) -> StreamingDataset:
            return StreamingDataset(
                cfg["url"],
                cache_dir=cache,
                shuffle=True,
                seed=5,
                shuffle_window=cfg["window"],
                max_cache_bytes=budget,
                storage_options=opts,
            )

        cache = os.path.join(cfg["cache"], f"node{node}")
        ds = make(cfg["budget"], cache)
        dl = CacheDataLoader(ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"])
        out: dict[str, Any] = {"keys": []}
        for epoch in range(2):
            out["keys"].append([k for batch in dl for k in batch["i"].tolist()])
            dist.barrier()  # as a DDP step would keep them together
            if rank == 0:
                for proxy in cfg["proxies"]:
                    mark(proxy, f"epoch-{epoch}")
            dist.barrier()
        out["window"] = ds._order().spec.window
        here = ds._world(cfg["workers"])
        out["nodes"] = here.nodes.to_json()
        # How the workers plan (their layout reached them with the epoch's plan: with a
        # plan of eight readers they would refuse this budget).
        spec = ds.epoch_spec(reader_place(ds._plan(here)[0], ds.epoch_total, here, 1, False))
        out["readers"], out["me"] = spec.readers, spec.me
        # A state's fields do not depend on the node layout (a roomy budget: the
        # requested window on any layout).
        roomy = make(cfg["roomy"], cache)
        out["state_two_nodes"] = roomy.state_for_step(3, num_workers=cfg["workers"])
        del dl
        ds.close()
        roomy.close()
        # One node of four under the same budget: refused (two chunks for each of its
        # readers do not fit), where each of two nodes runs.
        os.environ["LOCAL_WORLD_SIZE"] = str(world)
        os.environ["LOCAL_RANK"] = str(rank)
        one = make(cfg["budget"], os.path.join(cfg["cache"], f"one{rank}"))
        try:
            one.state_for_step(3, num_workers=cfg["workers"])
            out["one_node"] = "ran"
        except ConfigError as exc:
            out["one_node"] = str(exc)
        one.close()
        roomy = make(cfg["roomy"], os.path.join(cfg["cache"], f"one{rank}"))
        out["state_one_node"] = roomy.state_for_step(3, num_workers=cfg["workers"])
        roomy.close()
        # Without LOCAL_WORLD_SIZE, or with a LOCAL_RANK that shows the ranks of a node are
        # not consecutive, the nodes come from the hostnames (one host here).
        os.environ.pop("LOCAL_WORLD_SIZE")
        out["by_host"] = distributed.node_of_ranks()
        os.environ.update(LOCAL_WORLD_SIZE=str(LOCAL), LOCAL_RANK=str((rank + 1) % LOCAL))
        out["by_host_mismatch"] = distributed.node_of_ranks()
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()
