"""Data-parallel groups: which data reader a rank is. Pure: no I/O, no torch.

Under model parallelism (tensor, sequence, context, expert, pipeline) several ranks form one
model replica. Every rank of a replica must receive the *same* batches, in the same order,
while different replicas read disjoint parts of the epoch. The epoch is therefore split
over the *data-parallel* (DP) ranks, not over the global ranks: a DP rank is one reader of
the epoch, and every global rank that plays it reads exactly what the DP rank reads.

Invariant: the positions a process reads, its resume state and the read plan it follows
are pure functions of its ``(dp_rank, dp_size)`` (with its DataLoader worker): two ranks
of one DP rank are interchangeable, and a state saved on one loads on the other.
"""

from __future__ import annotations

__all__ = ["check_dp", "replicated"]


def check_dp(rank: object, size: object) -> tuple[int, int]:
    """``(rank, size)`` as ints, checked: ``0 <= rank < size``.

    Raises:
        ValueError: not two integers, or the rank is outside the size.
    """
    if isinstance(rank, bool) or isinstance(size, bool):
        raise ValueError(f"a data-parallel (rank, size) of integers, got ({rank!r}, {size!r})")
    try:
        r, s = int(rank), int(size)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"a data-parallel (rank, size) of integers, got ({rank!r}, {size!r})"
        ) from exc
    if r != rank or s != size:
        raise ValueError(f"a data-parallel (rank, size) of integers, got ({rank!r}, {size!r})")
    if not 0 <= r < s:
        raise ValueError(f"data-parallel rank {r} is outside a data-parallel size of {s}")
    return r, s


def replicated(rank: int, world: int, replication: int) -> tuple[int, int]:
    """The DP ``(rank, size)`` of global ``rank`` of ``world`` when consecutive groups of
    ``replication`` global ranks read the same data (ranks ``0 .. k-1`` are DP rank 0,
    ``k .. 2k-1`` DP rank 1, and so on: a tensor-parallel group of ``k`` ranks placed
    next to each other, as launchers number them).

    Raises:
        ValueError: ``replication`` is not a positive integer dividing ``world``.
    """
    if isinstance(replication, bool) or not isinstance(replication, int) or replication < 1:
        raise ValueError(f"replication must be a positive integer, got {replication!r}")
    if world % replication:
        raise ValueError(
            f"replication={replication} does not divide the world size {world}: every "
            "group of replicas must be whole"
        )
    return rank // replication, world // replication
