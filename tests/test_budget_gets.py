"""Datasets larger than the cache: every chunk is fetched once per epoch, the next epoch
starts warm, and a budget below two chunks per reader is refused at start.

GETs are counted per chunk by a fault proxy (no faults) in front of SeaweedFS, over
everything the DataLoader workers fetched.
"""

from __future__ import annotations

import logging
import re
import uuid

import pytest
import torch

from asynccache import CacheDataLoader, ConfigError, StreamingDataset
from asynccache.read.readplan import EpochSpec, ReaderPlace, plan_minimum
from asynccache.sampling.order import OrderSpec
from asynccache.testing.faults import FaultProxy
from tests.budget_data import Remote, chunk_gets, fetched_bytes, write_remote

ITEMS = 1501  # 108 chunks of 14 items (the last one short), not a multiple of the batch
BATCH = 8
WINDOW = 2
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory) -> Remote:
    src = tmp_path_factory.mktemp("budget-src")
    return write_remote(objstore, str(src), f"budget-{uuid.uuid4().hex[:8]}", ITEMS)


@pytest.fixture(scope="module")
def proxy(objstore):
    with FaultProxy(objstore.endpoint_url) as p:
        yield p


def loader(
    remote: Remote, proxy, cache_dir, budget: int, shuffle: bool, objstore
) -> CacheDataLoader:
    ds = StreamingDataset(
        remote.url,
        cache_dir=cache_dir,
        shuffle=shuffle,
        seed=5,
        shuffle_window=WINDOW,
        max_cache_bytes=budget,
        storage_options=dict(objstore.storage_options, endpoint_url=proxy.url),
    )
    return CacheDataLoader(ds, batch_size=BATCH, num_workers=2)


def epoch(dl: CacheDataLoader, proxy) -> tuple[list[int], dict[str, int]]:
    before = len(proxy.requests)
    keys = torch.cat([b["i"] for b in dl]).tolist()
    return keys, chunk_gets(proxy.requests[before:])


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_each_chunk_once_per_cold_epoch_and_the_next_epoch_starts_warm(
    remote, proxy, objstore, tmp_path, fraction, shuffle
):
    budget = int(remote.total * fraction)
    dl = loader(remote, proxy, tmp_path / "cache", budget, shuffle, objstore)
    keys, gets = epoch(dl, proxy)
    assert sorted(keys) == list(range(ITEMS))
    # Cold: every chunk exactly once, whatever the budget (at or above the minimum).
    assert gets == dict.fromkeys(remote.chunk_names, 1), f"GETs per chunk: {gets}"
    keys, gets = epoch(dl, proxy)
    assert sorted(keys) == list(range(ITEMS))
    assert max(gets.values(), default=0) <= 1, f"a chunk fetched twice in epoch 2: {gets}"
    # Warm: what the budget kept is not fetched again.
    again = fetched_bytes(gets, remote)
    assert again <= 1.1 * max(0, remote.total - budget), (again, remote.total, budget)
    if fraction == 1.0:
        assert again == 0


def test_a_budget_below_two_chunks_per_reader_is_refused_at_start_and_the_minimum_runs(
    remote, proxy, objstore, tmp_path, caplog
):
    chunk = max(c.bytes for c in remote.index.chunks)
    dl = loader(remote, proxy, tmp_path / "small", 4 * chunk - 1, True, objstore)
    before = len(proxy.requests)
    with pytest.raises(ConfigError, match="ASYNCCACHE_MAX_CACHE_BYTES") as err:
        list(dl)
    assert chunk_gets(proxy.requests[before:]) == {}, "nothing fetched before refusing"
    found = re.search(r"below the minimum of (\d+) bytes", str(err.value))
    assert found, str(err.value)
    minimum = int(found.group(1))
    assert minimum == 2 * 2 * chunk  # two chunks for each of the two workers
    # At the minimum the shuffle window shrinks (2 -> 1) and says so, every item comes
    # once, and every chunk is fetched; a chunk several readers share may be fetched by
    # each of them (the two workers, and the main process building the first batches:
    # whether it was evicted in between depends on timing), no other more than once.
    caplog.set_level(logging.INFO, logger="asynccache")
    dl = loader(remote, proxy, tmp_path / "least", minimum, True, objstore)
    keys, gets = epoch(dl, proxy)
    assert sorted(keys) == list(range(ITEMS))
    assert dl.dataset._order().spec.window == 1
    said = [r.getMessage() for r in caplog.records if "shuffle_window" in r.getMessage()]
    assert len(said) == 1 and "reading with shuffle_window 1" in said[0], said
    assert set(gets) == set(remote.chunk_names), gets
    readers = 2 + 1  # the workers and the main process
    again = {name: n for name, n in gets.items() if n > 1}
    assert all(n <= readers + 1 for n in again.values()), again
    assert sum(n - 1 for n in again.values()) <= 2 * readers, again
    # At the plan's own minimum for the whole window, each chunk once.
    place = ReaderPlace(0, (), 0, 1, 0, 2, 0, BATCH, False)
    spec = EpochSpec(place, OrderSpec(5, True, WINDOW))
    full = plan_minimum(remote.index, spec, WINDOW)
    dl = loader(remote, proxy, tmp_path / "exact", full, True, objstore)
    keys, gets = epoch(dl, proxy)
    assert sorted(keys) == list(range(ITEMS))
    assert dl.dataset._order().spec.window == WINDOW
    assert gets == dict.fromkeys(remote.chunk_names, 1), f"GETs per chunk: {gets}"
