"""Order of map-style epochs (the writing epoch, and datasets that own their Cache)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """All ``n`` keys in this epoch's order: identical for the same (n, seed, epoch)."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_share(order: list[int], rank: int, world_size: int) -> list[tuple[int, bool]]:
    """This rank's ``(key, first_time)`` pairs: every rank gets the same count.

    Like ``DistributedSampler``, the order is padded by repeating its start so it divides
    evenly (DDP needs equal step counts); ``first_time`` is False for those repeats.
    """
    n = len(order)
    if world_size == 1 or n == 0:
        return [(k, True) for k in order]
    total = -(-n // world_size) * world_size
    padded = [(order[i % n], i < n) for i in range(total)]
    return padded[rank:total:world_size]


def map_batch_count(n: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """How many batches each rank receives in a map-order epoch of ``n`` keys.

    Each rank's share is ``ceil(n / world_size)`` keys (see :func:`rank_share`); with
    ``drop_last`` its short last batch is not handed out.
    """
    share = n if world_size == 1 or n == 0 else -(-n // world_size)
    return share // batch_size if drop_last else -(-share // batch_size)


def map_batches(
    n: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    batch_size: int,
    drop_last: bool,
) -> list[list[int]]:
    """This rank's batches of keys in a map-order epoch, in the order they are handed out.

    The order of the writing epoch: :func:`epoch_order` split by :func:`rank_share`, cut
    into batches of ``batch_size``; with ``drop_last`` the short last batch is left out.
    ``len(result) == map_batch_count(n, world_size, batch_size, drop_last)``.
    """
    order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)
    share = [k for k, _ in rank_share(order, rank, world_size)]
    batches = [share[i : i + batch_size] for i in range(0, len(share), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


class EpochSampler(Sampler[int]):
    """This rank's keys for one epoch (see :func:`rank_share`)."""

    def __init__(
        self, n: int, *, shuffle: bool, seed: int, epoch: int, rank: int, world_size: int
    ) -> None:
        self._keys = [
            k
            for k, _ in rank_share(
                epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch), rank, world_size
            )
        ]

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ByKey(Dataset[Any]):
    """A written dataset read by key: ``ds[k]`` is the item ``stream`` wrote under key
    ``k`` (the rest of a writing epoch, read back in its order from the filled cache)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __len__(self) -> int:
        return int(self.stream.num_items)

    def __getitem__(self, key: int) -> Any:
        return self.stream[key]
