"""Where this process sits: rank and world size, DataLoader worker id and count, the
data-parallel rank it reads as (:class:`DataParallel`), and the node whose cache it shares
(:func:`node_layout`)."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import torch.distributed as dist
from torch.utils.data import get_worker_info

from ..config import launch_env, local_env
from ..errors import ConfigError
from ..sampling import nodes
from ..sampling.groups import check_dp, replicated
from ..sampling.nodes import NodeLayout


@dataclasses.dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1
    nodes: NodeLayout | None = None  # the DP ranks each node reads (None: one node)

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


def current(
    num_workers: int | None = None,
    captured: tuple[int, int] | None = None,
    nodes: NodeLayout | None = None,
) -> World:
    """This process's place. ``num_workers`` is the loader's count when called outside one.

    ``captured`` (the rank and world size a dataset reads as, which its main process
    worked out: the data-parallel ones) wins over what the process can see itself; a
    DataLoader worker can't see the process group. ``nodes``: the node layout the main
    process worked out (:func:`node_layout`).
    """
    info = get_worker_info()
    if captured is not None:
        rank, size = captured
    else:
        rank, size = rank_and_world()
    if info is not None:
        return World(rank, size, info.id, info.num_workers, nodes)
    return World(rank, size, 0, max(1, num_workers or 1), nodes)


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


class DataParallel:
    """How a dataset finds the data-parallel rank and size it reads as.

    Exactly one of (or none: every global rank reads its own part):

    * ``data_parallel=(dp_rank, dp_size)``: given;
    * ``data_parallel=group``: a ``torch.distributed`` process group of the ranks that
      read *different* data (this rank's data-parallel group): its rank and size;
    * ``replication=k``: consecutive groups of ``k`` global ranks read the same data
      (:func:`~asynccache.sampling.groups.replicated`).

    Resolved in the process that holds the process group (the main process); DataLoader
    workers get the result through the dataset's published plan. The group itself is
    not pickled (a worker never needs it); a copy in another process that is not a
    DataLoader worker can't resolve it and says so.

    Raises:
        ConfigError: both given, a malformed pair, a bad ``replication``.
    """

    def __init__(self, data_parallel: Any = None, replication: int | None = None) -> None:
        self.pair: tuple[int, int] | None = None
        self.group: Any = None
        self.grouped = False  # a group was given (a pickled copy holds it no more)
        self.replication = replication
        if data_parallel is not None and replication is not None:
            raise ConfigError(
                "give data_parallel= or replication=, not both (replication=k is "
                "data_parallel=(rank // k, world // k))"
            )
        if isinstance(data_parallel, (tuple, list)):
            if len(data_parallel) != 2:
                raise ConfigError(
                    f"data_parallel must be (dp_rank, dp_size) or a process group, got "
                    f"{data_parallel!r}"
                )
            try:
                self.pair = check_dp(data_parallel[0], data_parallel[1])
            except ValueError as exc:
                raise ConfigError(f"data_parallel: {exc}") from exc
        elif data_parallel is not None:
            group_type = getattr(dist, "ProcessGroup", None)
            if group_type is None or not isinstance(data_parallel, group_type):
                raise ConfigError(
                    "data_parallel must be (dp_rank, dp_size) or a torch.distributed "
                    f"process group, got {type(data_parallel).__name__}"
                )
            self.group = data_parallel
            self.grouped = True
        if replication is not None:
            try:
                replicated(0, replication, replication)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc

    @property
    def given(self) -> bool:
        """Something other than the global rank decides (a pair, a group, replication)."""
        return self.pair is not None or self.grouped or self.replication is not None

    def resolve(self) -> tuple[int, int]:
        """This process's data-parallel ``(rank, size)`` now.

        Raises:
            ConfigError: a group without an initialised process group or that this rank
                is not a member of; a world that ``replication`` doesn't divide.
        """
        if self.pair is not None:
            return self.pair
        if self.grouped and self.group is None:
            raise ConfigError(
                "this copy of the dataset was pickled into another process, and its "
                "data_parallel process group with it (process groups don't pickle): make "
                "the dataset in the process that reads it, or pass data_parallel=(dp_rank, "
                "dp_size)"
            )
        if self.group is not None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError(
                    "data_parallel=<process group> needs torch.distributed initialised"
                )
            rank = dist.get_rank(self.group)
            if rank < 0:
                raise ConfigError(
                    f"this rank ({dist.get_rank()}) is not a member of the data_parallel "
                    "process group; pass each rank its own data-parallel group"
                )
            return rank, dist.get_world_size(self.group)
        rank, world = rank_and_world()
        if self.replication is not None:
            try:
                return replicated(rank, world, self.replication)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        return rank, world

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["group"] = None  # (resolved in the main process; a worker has no group)
        return state


_hosts: list[str] | None = None  # every rank's hostname, gathered once per process


def _gather(value: object) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _group_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def node_of_ranks() -> list[int] | None:
    """The node of every global rank, or None when nothing tells (one node).

    From ``LOCAL_WORLD_SIZE`` (and ``LOCAL_RANK``, checked against it) when set: node
    ``rank // LOCAL_WORLD_SIZE``. Else, or where ``LOCAL_RANK`` shows that a node's ranks
    are not consecutive, from every rank's hostname, gathered over the default process
    group the first time it is needed in the process (a collective: every rank makes its
    datasets in the same order, as DDP needs anyway).

    Raises:
        ConfigError: ``LOCAL_WORLD_SIZE`` does not divide the world size, ``LOCAL_RANK``
            is outside it, or disagrees with the rank where no process group can tell
            the nodes by hostname.
    """
    global _hosts
    rank, world = rank_and_world()
    if world <= 1:
        return None
    local = local_env()
    if local is not None:
        try:
            return nodes.contiguous(rank, world, local[0], local[1])
        except nodes.LocalRankMismatch as exc:
            if not _group_up():
                raise ConfigError(
                    f"{exc}; launch with consecutive ranks per node (as torchrun does), or "
                    "initialise torch.distributed first so the nodes are told by hostname"
                ) from exc
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    if not _group_up():
        return None
    if _hosts is None or len(_hosts) != world:
        _hosts = [str(h) for h in _gather(socket.gethostname())]
    return nodes.by_host(_hosts)


def node_layout(dp: DataParallel, rank_world: tuple[int, int], reads: bool) -> NodeLayout | None:
    """The data-parallel ranks each node reads, for a dataset split as ``dp`` (this rank
    reads as ``rank_world``; ``reads``: False for a rank that reads nothing). None where
    there is one node, or where several nodes run without a process group and the DP
    ranks of the other ranks are not known (a ``data_parallel`` pair): every DP rank is
    then planned on every node, as for one node.

    Called in the main process when the dataset is made. Where there are several nodes
    and a process group, every rank's DP rank (None where it reads nothing) is gathered
    over it: a collective, so every rank makes its datasets in the same order (as DDP
    needs anyway). Without a group, the DP ranks follow from the global ranks
    (``replication``, or none given) and every rank counts as a reader.
    """
    node_of = node_of_ranks()
    if node_of is None or max(node_of) == 0:
        return None
    rank, world = rank_and_world()
    dp_of: list[int | None]
    if _group_up():
        dp_of = [None if d is None else int(d) for d in _gather(rank_world[0] if reads else None)]
    elif dp.pair is not None or dp.grouped:
        return None
    elif dp.replication is not None:
        dp_of = [r // dp.replication for r in range(world)]
    else:
        dp_of = list(range(world))
    return nodes.layout(node_of, dp_of, rank)
