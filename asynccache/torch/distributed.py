"""Where this process sits: rank and world size, DataLoader worker id and count."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.utils.data import get_worker_info

from ..config import launch_env
from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    @property
    def writer_id(self) -> int:
        """A number unique to this (rank, worker) pair, stable for a given world."""
        return self.rank * self.num_workers + self.worker


def rank_and_world() -> tuple[int, int]:
    """From ``torch.distributed`` when initialised, else ``RANK``/``WORLD_SIZE``, else (0, 1).

    DataLoader worker processes don't see the parent's process group: datasets capture
    this in the main process (see ``current(..., captured=...)``).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return launch_env() or (0, 1)


def current(num_workers: int | None = None, captured: tuple[int, int] | None = None) -> World:
    """This process's place. ``num_workers`` is the loader's count when called outside one.

    Inside a DataLoader worker, ``captured`` (the rank and world size the main process
    saw) wins over what the worker can see itself.
    """
    info = get_worker_info()
    if info is not None and captured is not None:
        rank, size = captured
    else:
        rank, size = rank_and_world()
    if info is not None:
        return World(rank, size, info.id, info.num_workers)
    return World(rank, size, 0, max(1, num_workers or 1))


def require_group(rank: int, world: int, what: str) -> None:
    """A world of several ranks needs an initialised process group (``RANK``/``WORLD_SIZE``
    alone can't carry the broadcasts ``what`` needs).

    Raises:
        ConfigError: there are several ranks and no initialised process group.
    """
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"{what} under RANK={rank} WORLD_SIZE={world} needs a torch.distributed "
            "process group (dist.init_process_group('gloo') before calling it)"
        )


def broadcast(value: object) -> object:
    """``value`` from rank 0 on every rank (identity when not distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value
