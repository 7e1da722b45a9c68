"""Quickstart: the first epoch writes the dataset as chunks, later epochs read them back."""

import os

import torch
from torch.utils.data import Dataset

from asynccache import CacheDataLoader


class RandomDataset(Dataset):  # as in Lightning's boring classes
    def __init__(self, size, length):
        self.data = torch.randn(length, size)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


if __name__ == "__main__":
    dataset = RandomDataset(64, 64)
    dataloader = CacheDataLoader(dataset, cache_dir="./cache", chunk_bytes=2 << 12)
    for batch in dataloader:  # noqa: B007 - the exact beginner snippet
        pass
    print(sorted(os.listdir("./cache")))
