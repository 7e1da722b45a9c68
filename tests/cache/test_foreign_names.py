"""Chunks the index names otherwise than ``chunk-*.bin`` are counted and evicted like any
(issue "trust, second round", item 15): the cache names its files itself."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from renamed import rename_chunks

from asynccache import StreamingDataset
from asynccache.cache.layout import SIDECAR_RE
from tests.helpers import uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(120)

ITEMS = 48
PER_CHUNK = 4


def _on_disk(cache: Path) -> int:
    """Bytes of every file in the cache but its locks and the index's column sidecar
    (kept outside the budget, see docs/cache.md): what the budget bounds. Read while
    downloads run: a temp file renamed or removed between the listing and its stat counts
    as gone."""
    total = 0
    for p in cache.rglob("*"):
        if ".locks" in p.parts or p.name == ".evict.lock" or SIDECAR_RE.fullmatch(p.name):
            continue
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


@pytest.mark.parametrize("name", ["data_{:04d}.bin", "shard.{}.tar", "chunk {}.bin"])
def test_chunks_named_otherwise_stay_within_the_budget(objstore, tmp_path, name) -> None:
    src = write_noise_dataset(tmp_path / "src", ITEMS, per_chunk=PER_CHUNK, size=2048)
    index = rename_chunks(src, name.format)
    sizes = {e.filename: e.bytes for e in index.chunks}
    total = sum(sizes.values())
    budget = total // 3  # a third of the dataset
    cache = tmp_path / "cache"
    with uploaded(src, objstore, "named") as url:
        ds = StreamingDataset(
            url, cache_dir=cache, storage_options=objstore.storage_options, max_cache_bytes=budget
        )
        seen = []
        for item in ds:
            seen.append(int(item["i"]))
            store = ds.source.store
            assert store is not None
            pinned = sum(sizes[n] for n in store.pinned() if n in sizes)
            assert _on_disk(cache) <= budget + pinned, (seen[-1], _on_disk(cache), pinned)
        evicted = store.evicted
        ds.close()
    assert sorted(seen) == list(range(ITEMS))
    assert _on_disk(cache) <= budget
    assert evicted >= index.num_chunks - budget // max(sizes.values())
    # Nothing of the dataset kept its foreign name in the cache: every file is one the
    # cache named (and so counts).
    assert not [f for _, _, files in os.walk(cache) for f in files if f in sizes]
