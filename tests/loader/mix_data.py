"""Small datasets for the mixing and subsample tests: item ``{"s": stream, "i": key}``."""

from __future__ import annotations

import os
from typing import Any

from asynccache import StreamingDataset
from asynccache.torch.mixed import MixedDataset, Stream
from asynccache.write.writer import ChunkWriter, merge_dir

SIZES = (300, 200, 100)
WEIGHTS = (0.5, 0.3, 0.2)
CHUNK = 20


def write_streams(root: str, sizes: tuple[int, ...] = SIZES) -> list[str]:
    """One directory per stream, chunks of ``CHUNK`` items."""
    dirs = []
    for s, n in enumerate(sizes):
        d = os.path.join(root, f"stream{s}")
        w = ChunkWriter(d, 0, chunk_size=CHUNK)
        for i in range(n):
            w.add(i, {"s": s, "i": i})
        w.finish()
        merge_dir(d, [0])
        dirs.append(d)
    return dirs


def mix(urls: list[str], mode: str = "random", batch_size: int = 8, **kw: Any) -> MixedDataset:
    """The three streams, shuffled with their own seeds, mixed by ``WEIGHTS``."""
    opts = kw.pop("stream_kw", {})
    streams = [
        Stream(StreamingDataset(u, shuffle=True, seed=s, **opts), weight=w)
        for s, (u, w) in enumerate(zip(urls, WEIGHTS, strict=True))
    ]
    return MixedDataset(streams, mode=mode, batch_size=batch_size, seed=3, **kw)


def pairs(batches: list[dict]) -> list[tuple[int, int]]:
    return [(int(s), int(i)) for b in batches for s, i in zip(b["s"], b["i"], strict=True)]


def upload_streams(objstore: Any, local: list[str], bucket: str) -> list[str]:
    """The streams uploaded to ``s3://bucket/stream{s}``."""
    from asynccache.config import Settings
    from asynccache.write.upload import upload

    urls = []
    for s, d in enumerate(local):
        url = f"s3://{bucket}/stream{s}"
        upload(d, url, objstore.storage_options, settings=Settings.from_env(progress=False))
        urls.append(url)
    return urls


def chunk_files(cache_dir: str) -> list[str]:
    """Chunk files in a cache directory (every dataset's)."""
    return sorted(
        f for _root, _dirs, files in os.walk(cache_dir) for f in files if f.endswith(".bin")
    )
