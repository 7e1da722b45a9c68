"""GET throughput through the storage layer vs a bare aiohttp loop, same server, same run.

Starts a SeaweedFS S3 server on loopback, stores 8 objects of 64 MiB, then reads them
all (as 16 ranged halves of 32 MiB, so 16 requests can be in flight) at concurrency
1, 4, 8 and 16: once through ``open_storage(...).iter_range`` and once through a plain
aiohttp loop signing its GETs with botocore. Prints a markdown table of median MB/s
(min-max over the trials) and the ratio storage / bare.

Run: ``python benchmarks/probes/storage_get.py [--objects 8] [--mib 64] [--trials 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # limits.py

import limits

from asynccache.config import Settings
from asynccache.storage import S3Storage, open_storage
from asynccache.testing import ObjectStore

Part = limits.Part


async def _storage_trial(store: ObjectStore, bucket: str, parts: list[Part], c: int) -> float:
    storage = open_storage(f"s3://{bucket}", Settings(max_concurrency=c), store.storage_options)

    async def fetch(part: Part) -> int:
        key, start, end = part
        n = 0
        async for piece in storage.iter_range(key, start, end):
            n += len(piece)
        return n

    try:
        await fetch((parts[0][0], 0, 1))  # warm the pool
        return await limits.run_parts(parts, c, fetch)
    finally:
        await storage.close()


async def _bare_trial(store: ObjectStore, bucket: str, parts: list[Part], c: int) -> float:
    return await limits.raw_get(limits.S3Target.of(store, bucket), parts, c)


async def _seed(store: ObjectStore, bucket: str, objects: int, size: int) -> list[str]:
    storage = open_storage(f"s3://{bucket}", Settings(), store.storage_options)
    assert isinstance(storage, S3Storage)
    keys = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "obj.bin")
        block = os.urandom(size)
        try:
            for i in range(objects):
                with open(path, "wb") as f:  # noqa: ASYNC230 - setup, not measured
                    f.write(i.to_bytes(8, "little") + block[8:])
                keys.append(f"bench/obj-{i:03d}.bin")
                await storage.upload(path, keys[-1])
        finally:
            await storage.close()
    return keys


async def _main(args: argparse.Namespace) -> None:
    size = args.mib << 20
    with ObjectStore(volume_size_limit_mb=max(256, args.mib * 4)) as store:
        bucket = "bench"
        store.create_bucket(bucket)
        keys = await _seed(store, bucket, args.objects, size)
        half = size // 2
        parts = [(k, s, s + half) for k in keys for s in (0, half)]
        total_mb = args.objects * size / 1e6
        print(
            f"{args.objects} objects x {args.mib} MiB = {total_mb:,.0f} MB per trial, "
            f"as {len(parts)} ranged GETs of {half >> 20} MiB; {args.trials} trials; "
            f"SeaweedFS pid {store.pid}\n"
        )
        print(f"{limits.versions('asynccache', 'aiohttp')}; {limits.machine()}")
        print("| concurrency | storage layer MB/s | bare aiohttp MB/s | storage / bare |")
        print("|---:|---:|---:|---:|")
        for c in args.concurrency:
            layer: list[float] = []
            bare: list[float] = []
            for trial in range(args.trials):
                # Alternate which goes first so neither always meets a warm server.
                runs = [(_storage_trial, layer), (_bare_trial, bare)]
                for fn, out in runs if trial % 2 == 0 else runs[::-1]:
                    out.append(total_mb / await fn(store, bucket, parts, c))
            ratios = [a / b for a, b in zip(layer, bare, strict=True)]
            print(
                f"| {c} | {limits.cell(layer)} | {limits.cell(bare)} | {limits.cell(ratios, '.2f')} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
