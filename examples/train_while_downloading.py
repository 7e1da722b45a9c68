"""Train a small model on CPU from a bucket, with a cold cache: the main job, end to end.

    python examples/train_while_downloading.py [--items 4096] [--epochs 2] [--out DIR]

1. starts a real S3 server (SeaweedFS) on loopback;
2. writes a synthetic image-classification dataset as chunks with CacheDataLoader;
3. uploads it to a bucket (index.json last);
4. trains from the bucket with an empty cache: StreamingDataset downloads chunks ahead
   of the DataLoader workers while the Fetcher overlaps the training step with loading;
5. prints items/s, MB downloaded and the data-stall share, then stops the server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm import tqdm

from asynccache import CacheDataLoader, Fetcher, Settings, StreamingDataset, upload
from asynccache.testing import ObjectStore

CLASSES = 10


class SyntheticImages(Dataset):
    """Item i: a 3x32x32 float image around a class prototype, and its class."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.prototypes = rng.normal(size=(CLASSES, 3, 32, 32)).astype(np.float32)
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng([self.seed, i])
        y = int(rng.integers(CLASSES))
        x = (self.prototypes[y] + rng.normal(scale=12.0, size=(3, 32, 32))).astype(np.float32) / 12
        return {"image": x, "label": y}


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
        if f.endswith(".bin")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--out",
        default="asynccache-demo",
        help="where the written dataset and the cache go (replaced each run)",
    )
    args = parser.parse_args()
    work = os.path.abspath(args.out)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    quiet = Settings.from_env(progress=False)

    with ObjectStore() as store:
        print(f"1. S3 server (SeaweedFS) at {store.endpoint_url}")
        store.create_bucket("demo")

        t0 = time.perf_counter()
        written = os.path.join(work, "written")
        for _ in CacheDataLoader(
            SyntheticImages(args.items), cache_dir=written, chunk_bytes=4 << 20, batch_size=256
        ):
            pass
        chunks = sorted(f for f in os.listdir(written) if f.endswith(".bin"))
        print(
            f"2. wrote {args.items} items as {len(chunks)} chunks "
            f"({dir_bytes(written) / 1e6:.1f} MB) in {written} "
            f"({time.perf_counter() - t0:.1f} s)"
        )

        url = "s3://demo/synthetic-images"
        summary = upload(written, url, store.storage_options, settings=quiet)
        print(
            f"3. uploaded {summary.objects} objects, {summary.bytes / 1e6:.1f} MB to {url} "
            f"in {summary.seconds:.2f} s (index.json last)"
        )

        cache_dir = os.path.join(work, "cache")
        dataset = StreamingDataset(
            url, cache_dir=cache_dir, shuffle=True, seed=0, storage_options=store.storage_options
        )
        loader = CacheDataLoader(dataset, batch_size=64, num_workers=2)
        model = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 32 * 32, 128), nn.ReLU(), nn.Linear(128, CLASSES)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        print(f"4. training from {url} with an empty cache in {cache_dir}")
        seen, t0 = 0, time.perf_counter()
        stall_wait = stall_wall = 0.0
        for epoch in range(args.epochs):
            correct = 0
            fetcher = Fetcher(loader, prefetch_batches=2)
            with (
                fetcher,
                tqdm(
                    total=len(loader),
                    desc=f"epoch {epoch}",
                    unit="batch",
                    leave=False,
                    disable=None,
                ) as bar,
            ):
                for batch in fetcher:
                    logits = model(batch["image"])
                    loss = nn.functional.cross_entropy(logits, batch["label"])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    seen += len(batch["label"])
                    correct += int((logits.argmax(1) == batch["label"]).sum())
                    bar.set_postfix(loss=f"{loss.item():.3f}")
                    bar.update()
            stall_wait += fetcher.stats.wait_s
            stall_wall += fetcher.stats.wall_s
            print(
                f"   epoch {epoch}: loss {loss.item():.3f}, accuracy "
                f"{correct / len(dataset):.1%}, data stall {fetcher.stats.stall_pct:.1f}% "
                f"({'cold: downloading' if epoch == 0 else 'warm: from the local cache'})"
            )
        elapsed = time.perf_counter() - t0

    print(
        f"5. {seen / elapsed:.0f} items/s over {args.epochs} epochs, "
        f"{dir_bytes(cache_dir) / 1e6:.1f} MB downloaded once into the cache, "
        f"data stall {100 * stall_wait / max(stall_wall, 1e-9):.1f}% of wall time"
    )
    print(f"   server stopped; the written dataset and the cache are in {work}")


if __name__ == "__main__":
    main()
