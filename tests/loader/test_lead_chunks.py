"""The chunks of the batches built in the main process: opened once, released before the fork.

The lead batches of a shuffled warm epoch draw their items from the same shuffle window,
so they share chunks. The main process maps each of those chunks once for all its lead
batches, and drops every mapping before the DataLoader workers are forked, so no worker
inherits one and the main process holds no chunk for the epoch.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

import asynccache.read.reader as reader_module
from asynccache import CacheDataLoader, StreamingDataset
from asynccache.config import Settings
from tests.helpers import write_noise_dataset
from tests.loader.mix_data import CHUNK, mix, write_streams

pytestmark = pytest.mark.timeout(120)

N, PER_CHUNK, ITEM, BS = 64, 16, 4 << 10, 4


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_noise_dataset(tmp_path_factory.mktemp("leadchunks") / "src", N, PER_CHUNK, ITEM)


def test_lead_batches_map_each_chunk_once_and_release_them_before_the_workers_start(
    written: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    maps: collections.Counter[str] = collections.Counter()
    real = reader_module.map_chunk

    def counted(path: str, *args: Any, **kw: Any) -> Any:
        maps[path] += 1  # (a forked worker counts in its own copy)
        return real(path, *args, **kw)

    monkeypatch.setattr(reader_module, "map_chunk", counted)
    settings = Settings.from_env(progress=False, first_batch_here=True)
    ds = StreamingDataset(str(written), shuffle=True, seed=3, settings=settings)
    loader = CacheDataLoader(ds, batch_size=BS, num_workers=2)
    it = iter(loader)
    first = next(it)
    # Both lead batches are built before the first is handed over, the workers forked
    # after: by now the main process holds no chunk open.
    assert not ds.reader._open
    assert ds._lead_open is None and not ds.unit_reader._forms
    lead = dict(maps)
    second = next(it)
    rest = list(it)
    assert len(rest) + 2 == N // BS
    assert ds.lead_stats.batches == 2
    # The two lead batches share a chunk (else this test shows nothing).
    chunks = [{int(i) // PER_CHUNK for i in b["i"]} for b in (first, second)]
    assert chunks[0] & chunks[1], chunks
    assert set(lead) and len(lead) == len(chunks[0] | chunks[1])
    again = [p for p, n in lead.items() if n > 1]
    assert not again, f"mapped again for the second lead batch: {again}"
    ds.close()


def test_a_mix_s_lead_batches_map_each_chunk_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a mix: each stream's chunks are mapped once for both lead batches
    (they were closed and mapped again after the first), and closed before the forks."""
    maps: collections.Counter[str] = collections.Counter()
    real = reader_module.map_chunk

    def counted(path: str, *args: Any, **kw: Any) -> Any:
        maps[path] += 1
        return real(path, *args, **kw)

    streams = write_streams(str(tmp_path))
    monkeypatch.setattr(reader_module, "map_chunk", counted)
    kw = {"stream_kw": {"settings": Settings.from_env(progress=False, first_batch_here=True)}}
    ds = mix(streams, "stratified", batch_size=8, **kw)
    loader = CacheDataLoader(ds, batch_size=8, num_workers=2)
    # The chunks in the cache first (a mix builds its lead batches from cached chunks).
    assert sum(len(b["i"]) for b in loader) == sum(ds.stream_counts)
    maps.clear()
    it = iter(loader)
    first = next(it)
    assert ds.lead_stats.batches == 4  # two in each of the two epochs
    assert all(not s.reader._open for s in ds.streams)
    lead = dict(maps)
    second = next(it)
    assert len(list(it)) + 2 == -(-sum(ds.stream_counts) // 8)
    shared = {(int(s), int(i) // CHUNK) for s, i in zip(first["s"], first["i"], strict=True)}
    shared &= {(int(s), int(i) // CHUNK) for s, i in zip(second["s"], second["i"], strict=True)}
    assert shared  # the two lead batches read some chunk of the same stream
    again = [p for p, n in lead.items() if n > 1]
    assert lead and not again, f"mapped again for the second lead batch: {again}"
