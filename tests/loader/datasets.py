"""Datasets for the loader tests (importable, so spawned workers can unpickle them)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch
from torch.utils.data import Dataset

from asynccache import Cache


class RandomDataset(Dataset):
    def __init__(self, size: int, length: int, seed: int = 0) -> None:
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class DictDataset(Dataset):
    """Items with several leaf types; item i is recognisable by its ``"i"``."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return {
            "i": i,
            "x": np.full((3,), i, dtype=np.float32),
            "name": f"item-{i}",
            "t": torch.tensor([i, -i], dtype=torch.int64),
        }


class ExplodingDataset(Dataset):
    """Sized but unreadable: proves a filled cache never touches the dataset."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> None:
        raise AssertionError("the dataset was read although the cache is filled")


class SelfCachingDataset(Dataset):
    """The "advanced" pattern: the dataset fills its own Cache on the first pass."""

    def __init__(self, cache_dir: str, length: int = 30) -> None:
        self.cache = Cache(cache_dir, chunk_size=4)
        if not self.cache.filled:
            self.data = [{"i": i, "v": np.arange(i, dtype=np.int16)} for i in range(length)]

    def __len__(self) -> int:
        return len(self.cache) if self.cache.filled else len(self.data)

    def __getitem__(self, index: int) -> int:
        data = self.cache[index] if self.cache.filled else self.data[index]
        if not self.cache.filled:
            self.cache[index] = data
        assert len(data["v"]) == data["i"] == index
        return data["i"]


def key_and_pid(item: dict) -> tuple[int, int]:
    """A transform recording which process read the item."""
    import os

    return int(item["i"]), os.getpid()


Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Sample:
    """A dataclass item: rebuilt as a Sample on read."""

    image: torch.Tensor
    label: int
    meta: dict
    where: Point
