"""Nodes: which ranks share a cache directory, and which data-parallel ranks each reads.
Pure: no I/O, no torch.

A *node* is the set of global ranks whose processes share one cache directory (one
machine). Its read plan counts only the readers of those ranks: the data-parallel (DP)
ranks they play, each once however many replicas of it run there, times the DataLoader
workers. Ranks are grouped into nodes from the launcher's ``LOCAL_WORLD_SIZE`` /
``LOCAL_RANK`` (:func:`contiguous`: torchrun numbers the ranks of a node consecutively)
or from the hostnames the ranks report (:func:`by_host`).

Invariant: a :class:`NodeLayout` is the same on every rank of a job except for
``mine``, so every node computes every other node's plan identically (the shuffle window
is fitted to the largest of them, and the order stays one order for the whole job).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["LocalRankMismatch", "NodeLayout", "by_host", "contiguous", "layout"]


class LocalRankMismatch(ValueError):
    """``LOCAL_RANK`` is not ``rank % LOCAL_WORLD_SIZE``: the launcher did not number each
    node's ranks consecutively, so ``rank // LOCAL_WORLD_SIZE`` does not name the node."""


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The DP ranks each node reads (``groups``, each sorted, in node order; a node whose
    ranks read nothing has an empty group) and which node this process is on (``mine``)."""

    groups: tuple[tuple[int, ...], ...]
    mine: int

    def __post_init__(self) -> None:
        if not 0 <= self.mine < len(self.groups):
            raise ValueError(f"node {self.mine} is outside {len(self.groups)} nodes")

    @property
    def ranks(self) -> tuple[int, ...]:
        """The DP ranks read on this node."""
        return self.groups[self.mine]

    def distinct(self) -> list[tuple[int, ...]]:
        """The nodes' groups of DP ranks, each once, empty ones left out (two nodes
        reading the same DP ranks have the same plan)."""
        return [g for g in dict.fromkeys(self.groups) if g]

    def to_json(self) -> dict[str, Any]:
        return {"groups": [list(g) for g in self.groups], "mine": self.mine}

    @classmethod
    def from_json(cls, raw: Any) -> NodeLayout | None:
        if raw is None:
            return None
        return cls(tuple(tuple(int(r) for r in g) for g in raw["groups"]), int(raw["mine"]))


def contiguous(rank: int, world: int, local_rank: int | None, local_world: int) -> list[int]:
    """The node of each of ``world`` global ranks when each node runs ``local_world``
    consecutive ranks (node ``r // local_world``), as torchrun launches them.

    Raises:
        ValueError: ``local_world`` is not a positive divisor of ``world``, or
            ``local_rank`` is outside it.
        LocalRankMismatch: ``local_rank`` is not ``rank % local_world`` (the ranks of a
            node are not consecutive).
    """
    if local_world < 1 or world % local_world:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_world} does not divide the world size {world}: "
            "every node runs the same number of ranks"
        )
    if local_rank is not None:
        if not 0 <= local_rank < local_world:
            raise ValueError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}")
        if local_rank != rank % local_world:
            raise LocalRankMismatch(
                f"LOCAL_RANK={local_rank} is not rank {rank} % LOCAL_WORLD_SIZE={local_world}: "
                "the ranks of a node are not numbered consecutively"
            )
    return [r // local_world for r in range(world)]


def by_host(hosts: Sequence[str]) -> list[int]:
    """The node of each rank from the host each reported: nodes numbered in the order
    their first rank appears."""
    first: dict[str, int] = {}
    return [first.setdefault(h, len(first)) for h in hosts]


def layout(node_of: Sequence[int], dp_of: Sequence[int | None], rank: int) -> NodeLayout | None:
    """The DP ranks each node reads, from the node of each global rank (``node_of``) and
    the DP rank each plays (``dp_of``; None: it reads nothing, a pipeline stage after
    the first), for global ``rank``. None when there is one node (every rank shares the
    cache, the plan counts every DP rank).
    """
    count = max(node_of) + 1 if len(node_of) else 1
    if count <= 1:
        return None
    groups: list[set[int]] = [set() for _ in range(count)]
    for node, dp in zip(node_of, dp_of, strict=True):
        if dp is not None:
            groups[node].add(dp)
    return NodeLayout(tuple(tuple(sorted(g)) for g in groups), node_of[rank])
