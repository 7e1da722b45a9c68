"""A chunk the first batch reads mostly by range is fetched whole instead, so it lands in
the cache: the next epoch reads nothing from the store.

Items read by range are not kept. Where the first batch covers whole chunks (chunks of a
few items, batches of many), those chunks used to be read entirely by range and never
downloaded, and every later epoch, warm ones included, read them by range again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.testing.faults import FaultProxy
from tests.helpers import uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(180)

PER_CHUNK, ITEM = 12, 100 << 10  # chunks of 1.2 MiB: above the 1 MiB that ranges start at
ITEMS = 8 * PER_CHUNK + 5


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_the_next_epoch_reads_nothing_after_a_first_batch_of_whole_chunks(
    objstore, tmp_path: Path, shuffle: bool
) -> None:
    src = write_noise_dataset(tmp_path / "src", ITEMS, PER_CHUNK, ITEM)
    with uploaded(src, objstore, "warmrange") as url, FaultProxy(objstore.endpoint_url) as proxy:
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = StreamingDataset(
            url, cache_dir=tmp_path / "c", storage_options=options, shuffle=shuffle, seed=1
        )
        dl = CacheDataLoader(ds, batch_size=28, num_workers=2)
        epochs = []
        for _ in range(2):
            before = len(proxy.requests)
            keys = torch.cat([b["i"] for b in dl]).tolist()
            assert sorted(keys) == list(range(ITEMS))
            epochs.append(
                [r for r in proxy.requests[before:] if r.method == "GET" and "chunk-" in r.path]
            )
        ds.close()
    first, second = epochs
    ranged = [r for r in first if r.range and not r.range.startswith("bytes=0-")]
    assert ranged or shuffle, "no item was read by range in epoch 1: the test proves nothing"
    assert second == [], [(r.path.rsplit("/", 1)[-1], r.range) for r in second]
