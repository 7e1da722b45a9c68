"""Batches of large items are read from the chunk files into the batch buffer: no page
of a chunk stays mapped in the reading process (its PSS), and the bytes are the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import Dataset

from asynccache import CacheDataLoader, StreamingDataset
from tests.loader.test_batch import per_item, same

ITEM = 128 << 10  # rows of this size are read with preadv (batchread._LARGE_ROW: 16 KiB)
N = 40
BATCH = 4


class Large(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        rng = np.random.default_rng(i)
        return {"img": rng.integers(0, 255, ITEM, np.uint8), "y": i}


def chunk_rss(root: Path) -> int:
    """Resident bytes of every mapping of a file under ``root`` in this process."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) == 6 and head[5].startswith(str(root))
            elif inside and head[0] == "Rss:":
                total += int(head[1]) << 10
    return total


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("large")
    list(CacheDataLoader(Large(), cache_dir=path, chunk_size=16, batch_size=8))
    return path


@pytest.mark.parametrize("shuffle", [False, True])
def test_large_rows_leave_no_chunk_pages_mapped(large, shuffle):
    """The bug: rows copied through the mapping kept every page read mapped (a worker's
    PSS grew by the chunks it held open, 256 MiB per 2 workers in a cold epoch). Now the
    chunk files' resident mapped bytes stay under one batch's bytes (headers only)."""
    ds = StreamingDataset(large, shuffle=shuffle, seed=3)
    ref = list(
        CacheDataLoader(
            StreamingDataset(large, shuffle=shuffle, seed=3),
            batch_size=BATCH,
            collate_fn=per_item,
        )
    )
    most = 0
    got = []
    for b in CacheDataLoader(ds, batch_size=BATCH):
        most = max(most, chunk_rss(large))
        got.append(b)
    assert ds.batch_stats()["assembled"] == len(got) == N // BATCH
    for a, r in zip(got, ref, strict=True):
        same(a, r)
    assert most < BATCH * ITEM
