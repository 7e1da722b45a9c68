"""index.json stays O(chunks) whatever the order items are written in."""

from __future__ import annotations

import mmap
import os
import random

import numpy as np

from asynccache import CacheDataLoader
from asynccache.cache.indexfile import read_dir
from asynccache.format import ChunkView, decode
from asynccache.format.columns import sidecar_name
from asynccache.write.writer import (
    SORTED_WRITER,
    ChunkWriter,
    merge_dir,
    read_index,
    remove_partial,
)
from tests.loader.datasets import DictDataset

# 100k tiny items written shuffled: one [key, 1] run each would be ~31 bytes x 100k = 3 MB.
INDEX_LIMIT = 16 << 10


def stored(directory: str, every: int = 1) -> dict[int, object]:
    """key -> decoded item, read from the chunk files the index names (every ``every``-th)."""
    idx = read_index(os.path.join(directory, "index.json"))
    out = {}
    for ci, c in enumerate(idx.chunks):
        with open(os.path.join(directory, c.filename), "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = ChunkView(buf, c.filename)
        for pos, key in enumerate(idx.chunk_keys(ci).tolist()):
            if key % every == 0 or pos in (0, view.count - 1):  # and each chunk's ends
                out[key] = decode(buf, *view.span(pos), where=c.filename)
    return out


def test_100k_items_written_in_shuffled_order_by_two_writers_stay_compact(tmp_path):
    n = 100_000
    keys = list(range(n))
    random.Random(1).shuffle(keys)
    d = str(tmp_path)
    writers = [ChunkWriter(d, w, chunk_bytes=1 << 20) for w in range(2)]
    for j, k in enumerate(keys):  # like a shuffled epoch split over two DataLoader workers
        writers[j % 2].add(k, k)
    for w in writers:
        w.finish()
    idx = merge_dir(d, [0, 1])
    size = os.path.getsize(os.path.join(d, "index.json"))
    assert size < INDEX_LIMIT, size
    assert all(len(c.keys) == 1 for c in idx.chunks)
    # the rewritten chunks replaced the scattered ones (the writers' own indexes stay)
    assert sorted(os.listdir(d)) == sorted(
        ["0.index.json", "1.index.json", "index.json", sidecar_name(idx.checksum[8:])]
        + [f"chunk-{SORTED_WRITER}-{i}.bin" for i in range(len(idx.chunks))]
    )
    assert idx.total_items == n  # (the merge checks that the runs cover 0..n-1 once)
    got = stored(d, every=7)  # a sample, plus the first and last item of every chunk
    assert len(got) > n // 7 and all(got[k] == k for k in got)


def test_items_in_order_are_not_rewritten(tmp_path):
    d = str(tmp_path)
    w = ChunkWriter(d, 0, chunk_size=10)
    for k in range(50):
        w.add(k, np.full(4, k))
    w.finish()
    idx = merge_dir(d, [0])
    assert [c.filename for c in idx.chunks] == [f"chunk-0-{i}.bin" for i in range(5)]


def test_shuffled_writing_epoch_of_the_loader_gives_one_run_per_chunk(tmp_path):
    n = 600
    dl = CacheDataLoader(
        DictDataset(n), cache_dir=tmp_path, chunk_size=25, batch_size=16, num_workers=2,
        shuffle=True, seed=3,
    )  # fmt: skip
    seen = [int(i) for batch in dl for i in batch["i"]]
    assert sorted(seen) == list(range(n))
    chunks = read_dir(str(tmp_path)).chunks
    assert all(len(c.keys) == 1 for c in chunks)
    assert len(chunks) == n // 25
    got = stored(str(tmp_path))
    assert all(got[k]["i"] == k and got[k]["name"] == f"item-{k}" for k in range(n))
    # and the second epoch reads the rewritten chunks
    assert sorted(int(i) for batch in dl for i in batch["i"]) == list(range(n))


def test_a_rewrite_cut_short_is_cleared_by_the_next_pass(tmp_path):
    """A crash during the rewrite leaves no index.json: remove_partial clears its chunks."""
    d = str(tmp_path)
    w = ChunkWriter(d, 0, chunk_size=4)
    for k in [5, 0, 7, 2, 1, 6, 3, 4]:
        w.add(k, k)
    w.finish()
    with open(os.path.join(d, f"chunk-{SORTED_WRITER}-0.bin"), "wb") as f:
        f.write(b"half a rewritten chunk")
    remove_partial(d)
    assert os.listdir(d) == []
