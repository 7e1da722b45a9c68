"""A dataset that fills its own Cache on the first pass, trained on 2 processes (gloo, CPU).

    python examples/image_dataset.py [--cache-dir ./cache-images] [--workers-start forkserver]

Epoch 1 decodes the in-memory images and writes them into the cache; epoch 2 reads them
back from the chunk files. Each process (rank) sees half of the dataset per epoch.

The DataLoader workers of a rank started by ``mp.spawn`` are spawned too, each importing
torch again, twice per epoch. ``--workers-start forkserver`` starts them from a fork server
per rank that imports torch once (``fork`` would fork the rank itself).
"""

import argparse
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch.utils.data import Dataset

from asynccache import Cache, CacheDataLoader


def create_random_images(size, num_classes, seed=0):
    rng = np.random.default_rng(seed)  # the same images on every rank
    return [
        {
            "image": Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)),
            "class": int(rng.integers(0, num_classes)),
        }
        for _ in range(size)
    ]


class BoringImageDataset(Dataset):
    def __init__(self, cache_dir, size=100, num_classes=10):
        self.cache = Cache(cache_dir, chunk_size=2 << 12)
        if not self.cache.filled:
            self.data = create_random_images(size, num_classes)

    def __len__(self):
        return len(self.cache) if self.cache.filled else len(self.data)

    def __getitem__(self, index):
        data = self.cache[index] if self.cache.filled else self.data[index]
        if not self.cache.filled:
            self.cache[index] = data
        image = torch.from_numpy(np.array(data["image"])).permute(2, 0, 1).float() / 255
        return image, data["class"], index


def run(rank, world_size, port, cache_dir, workers_start=None):
    if workers_start == "forkserver":
        # imported once by the fork server; the workers it forks find them loaded
        mp.set_forkserver_preload(["torch", "numpy", "PIL.Image", "asynccache.torch.cache"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    dataloader = CacheDataLoader(
        BoringImageDataset(cache_dir),
        num_workers=2,
        batch_size=4,
        multiprocessing_context=workers_start,  # None: as the rank was started (spawn)
    )
    sums = []
    for epoch in range(2):
        seen, total = [], 0.0
        for images, _classes, indices in dataloader:
            total += float(images.sum())
            seen.extend(indices.tolist())
        counts = torch.tensor([len(seen), len(set(seen))])
        dist.all_reduce(counts)
        sums.append(round(total, 3))
        line = (
            f"rank {rank} epoch {epoch}: {len(seen)} items, {len(dataloader)} batches, "
            f"all ranks: {int(counts[0])} items ({'cache' if epoch else 'writing'})\n"
        )
        sys.stdout.write(line)  # one write per line: ranks share the terminal
        sys.stdout.flush()
    assert sums[0] == sums[1], f"rank {rank}: epoch 2 from the cache differs from epoch 1"
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", default="./cache-images")
    parser.add_argument("--workers-start", choices=["spawn", "forkserver", "fork"])
    args = parser.parse_args()
    mp.spawn(run, args=(2, free_port(), args.cache_dir, args.workers_start), nprocs=2)
