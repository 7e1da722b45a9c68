"""A small remote dataset and GET counting for the cache-budget tests."""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asynccache.config import Settings
from asynccache.format import Index
from asynccache.read.readplan import EpochSpec, PlanCache, ReaderPlace
from asynccache.sampling.order import OrderSpec
from asynccache.testing.faults import RequestRecord
from asynccache.write.upload import upload
from asynccache.write.writer import ChunkWriter, merge_dir

ITEM_BYTES = 1000
CHUNK_BYTES = 16 << 10


@dataclass(frozen=True)
class Remote:
    url: str
    index: Index

    @property
    def total(self) -> int:
        return sum(c.bytes for c in self.index.chunks)

    @property
    def chunk_names(self) -> list[str]:
        return [c.filename for c in self.index.chunks]


def write_remote(objstore: Any, directory: str, bucket: str, items: int) -> Remote:
    """``items`` dict items of about 1 KB, in chunks of at most 16 KiB, uploaded to S3."""
    w = ChunkWriter(directory, 0, chunk_bytes=CHUNK_BYTES)
    rng = np.random.default_rng(0)
    for i in range(items):
        w.add(i, {"i": i, "x": rng.integers(0, 255, ITEM_BYTES, dtype=np.uint8)})
    w.finish()
    index = merge_dir(directory, [0])
    objstore.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    upload(directory, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    return Remote(url, index)


def chunk_gets(requests: Iterable[RequestRecord]) -> collections.Counter[str]:
    """GETs per chunk file name (ranged parts of one chunk count once per request)."""
    return collections.Counter(
        os.path.basename(r.path)
        for r in requests
        if r.method == "GET" and os.path.basename(r.path).startswith("chunk-")
    )


def fetched_bytes(gets: collections.Counter[str], remote: Remote) -> int:
    size = {c.filename: c.bytes for c in remote.index.chunks}
    return sum(size[name] * n for name, n in gets.items())


def write_chunks(objstore: Any, directory: str, bucket: str, chunks: int, per: int) -> Remote:
    """About ``chunks`` chunks of ``per`` items of about 1 KB each (chunks of
    ``per`` KB), uploaded to S3."""
    w = ChunkWriter(directory, 0, chunk_bytes=per * (ITEM_BYTES + 60))
    rng = np.random.default_rng(1)
    for i in range(chunks * per):
        w.add(i, {"i": i, "x": rng.integers(0, 255, ITEM_BYTES, dtype=np.uint8)})
    w.finish()
    index = merge_dir(directory, [0])
    objstore.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    upload(directory, url, objstore.storage_options, settings=Settings.from_env(progress=False))
    return Remote(url, index)


def whole_downloads(requests: Iterable[RequestRecord], remote: Remote) -> tuple[int, int]:
    """(bytes of whole-chunk downloads, bytes of other ranged chunk GETs). A download is a
    GET of a chunk file without a range, or of one whole part (from a part boundary to the
    next or to the chunk's end); the other ranged GETs are a reader's range reads of its
    first items before their chunks land (``first_read_bytes``), never cached."""
    sizes = {c.filename: c.bytes for c in remote.index.chunks}
    part = Settings().part_bytes
    whole = ranged = 0
    for r in requests:
        name = os.path.basename(r.path)
        if r.method != "GET" or name not in sizes:
            continue
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", r.range or "")
        if m is None:
            whole += sizes[name]
            continue
        a, b = int(m.group(1)), min(int(m.group(2)) + 1, sizes[name])
        if a % part == 0 and b == min(a + part, sizes[name]):
            whole += b - a
        else:
            ranged += b - a
    return whole, ranged


@dataclass(frozen=True)
class Bounds:
    """What two epochs under a budget may fetch at most (see :func:`bounds`)."""

    dataset: int
    cold: int
    warm: int
    target: int  # 1.1 x (dataset - budget)


def bounds(
    index: Index, order: OrderSpec, budget: int, world: int, workers: int, batch: int
) -> Bounds:
    """The most bytes epochs 0 and 1 read by ``world`` ranks x ``workers`` readers in
    ``order`` may fetch under ``budget``, worked out here from the node's plan of them:

    * cold: each chunk once; below the plan's minimum (what the readers hold at once
      plus the chunks two of them read) a chunk two readers read may come twice;
    * warm: the target ``1.1 x (dataset - budget)``, except where the epoch boundary takes
      more room than its slack: then ``dataset - budget``, plus the chunks the readers
      hold as epoch 0 ends (each reader's last chunk; its last window, shuffled), plus
      those each holds at once as epoch 1 starts (its opening), plus one chunk; never
      more than the cold epoch.
    """
    place = ReaderPlace(
        epoch=0,
        remaining=((0, index.total_items),),
        received=0,
        world=world,
        rank=0,
        num_workers=max(1, workers),
        worker=0,
        batch_size=batch,
        drop_last=False,
    )
    plans = PlanCache(index, EpochSpec(place, order))
    this, following = plans(0, 0), plans(1, 0)
    assert this is not None and following is not None
    sizes = np.asarray(index.bytes_per_chunk, dtype=np.int64)
    dataset = int(sizes.sum())
    below = budget < max(this.min_bytes, following.min_bytes)
    shared = np.zeros(len(sizes), dtype=bool)
    shared[list(following.shared | this.shared)] = True
    cold = dataset + (int(sizes[shared].sum()) if below else 0)
    target = int(1.1 * max(0, dataset - budget))
    edge = np.zeros(len(sizes), dtype=bool)
    for st in this.streams:  # held at each reader's last position
        edge[st.chunks[st.ends >= st.length]] = True
    for st in following.streams:  # held when each reader's first run ends
        if len(st.chunks):
            first_end = st.ends[st.starts == st.starts.min()].min()
            edge[st.chunks[st.starts < first_end]] = True
    if budget >= dataset:
        warm = 0
    else:
        boundary = dataset - budget + int(sizes[edge].sum()) + int(sizes.max())
        warm = min(cold, max(target, boundary + (cold - dataset)))
    return Bounds(dataset, cold, warm, target)
