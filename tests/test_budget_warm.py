"""The next epoch starts warm under a cache budget, as users run it (hypothesis).

Over chunk counts from about 20 to about 400 (up to 50 chunks for each of 8 readers),
budgets of 0.25, 0.5 and 0.75 of the dataset, 0, 2 and 8 DataLoader workers, persistent
or not, in order and shuffled, and a cache dir given absolute or relative to the working
directory: two epochs through
``CacheDataLoader``, every whole-chunk download counted at a real proxy in front of the
real S3 server. Each epoch yields every item once; the cold epoch fetches each chunk once
(below the plan's minimum, a chunk two readers read may come twice); the second fetches at
most ``1.1 x (dataset - budget)``, or, where the epoch boundary takes more room than that
slack (few chunks per reader), what :func:`tests.budget_data.bounds` works out from the
node's plan. A budget below two chunks per reader is refused with ``ConfigError`` naming
the minimum in bytes, before anything is fetched.

The explicit examples are the reported setups scaled down (82 chunks, half the dataset,
a relative cache dir: shuffled with 2 workers, in order with 2 workers, persistent, and
without workers; 16 chunks at 0.6 with 2 workers) and 8 shuffled workers, which needed
a budget of several times the dataset before the window shrank to fit.
"""

from __future__ import annotations

import contextlib
import re
import uuid

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, ConfigError, StreamingDataset
from asynccache.sampling.order import OrderSpec
from asynccache.testing.faults import FaultProxy
from tests.budget_data import Remote, bounds, whole_downloads, write_chunks

PER = 16  # items of about 1 KB per chunk
BATCH = 16
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def proxy(objstore):
    with FaultProxy(objstore.endpoint_url) as p:
        yield p


@pytest.fixture(scope="module")
def datasets(objstore, tmp_path_factory):
    """A dataset of about ``n`` chunks, written and uploaded once per ``n``."""
    made: dict[int, Remote] = {}

    def get(n: int) -> Remote:
        if n not in made:
            src = tmp_path_factory.mktemp(f"warm-src-{n}")
            made[n] = write_chunks(objstore, str(src), f"warm-{uuid.uuid4().hex[:8]}", n, PER)
        return made[n]

    return get


def two_epochs(
    remote: Remote,
    proxy,
    objstore,
    cache_dir: str,
    budget: int,
    workers: int,
    shuffle: bool,
    persistent: bool,
) -> tuple[list[tuple[int, int]], int]:
    """(whole, ranged) bytes fetched in each of two epochs, and the window read with."""
    ds = StreamingDataset(
        remote.url,
        cache_dir=cache_dir,
        shuffle=shuffle,
        seed=9,
        max_cache_bytes=budget,
        storage_options=dict(objstore.storage_options, endpoint_url=proxy.url),
    )
    kw = {"persistent_workers": True} if persistent and workers else {}
    dl = CacheDataLoader(ds, batch_size=BATCH, num_workers=workers, **kw)
    got = []
    try:
        for _ in range(2):
            before = len(proxy.requests)
            keys = torch.cat([b["i"] for b in dl]).tolist()
            assert sorted(keys) == list(range(remote.index.total_items)), "an item lost or twice"
            got.append(whole_downloads(proxy.requests[before:], remote))
        window = ds._order().spec.window
    finally:
        del dl
        ds.close()
    return got, window


@settings(
    max_examples=3,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    chunks=st.integers(20, 400),
    fraction=st.sampled_from([0.25, 0.5, 0.75]),
    workers=st.sampled_from([0, 2, 8]),
    shuffle=st.booleans(),
    persistent=st.booleans(),
    relative=st.booleans(),
)
@example(chunks=82, fraction=0.5, workers=2, shuffle=True, persistent=False, relative=True)
@example(chunks=82, fraction=0.5, workers=2, shuffle=False, persistent=False, relative=True)
@example(chunks=82, fraction=0.5, workers=2, shuffle=False, persistent=True, relative=True)
@example(chunks=82, fraction=0.5, workers=0, shuffle=False, persistent=False, relative=True)
@example(chunks=16, fraction=0.6, workers=2, shuffle=False, persistent=False, relative=False)
@example(chunks=82, fraction=0.5, workers=8, shuffle=True, persistent=False, relative=False)
def test_the_next_epoch_starts_warm_under_any_budget_of_two_chunks_per_reader(
    datasets, proxy, objstore, tmp_path_factory, chunks, fraction, workers, shuffle, persistent,
    relative,
):  # fmt: skip
    remote = datasets(chunks)
    budget = int(remote.total * fraction)
    home = tmp_path_factory.mktemp("warm-cache")
    cache = "cache" if relative else str(home / "cache")
    readers = max(1, workers)
    least = 2 * readers * max(c.bytes for c in remote.index.chunks)
    before = len(proxy.requests)
    with contextlib.chdir(home):
        if budget < least:
            with pytest.raises(ConfigError, match=r"below the minimum of (\d+) bytes") as err:
                two_epochs(remote, proxy, objstore, cache, budget, workers, shuffle, persistent)
            assert re.search(rf"minimum of {least} bytes", str(err.value)), str(err.value)
            assert whole_downloads(proxy.requests[before:], remote) == (0, 0)
            return
        got, window = two_epochs(
            remote, proxy, objstore, cache, budget, workers, shuffle, persistent
        )
    b = bounds(remote.index, OrderSpec(9, shuffle, window), budget, 1, workers, BATCH)
    (cold, _), (warm, _) = got
    say = (
        f"{remote.index.num_chunks} chunks, budget {fraction}, {workers} workers, shuffle "
        f"{shuffle} (window {window}), persistent {persistent}, relative {relative}: epoch 1 "
        f"{cold / b.dataset:.3f} (at most {b.cold / b.dataset:.3f}), epoch 2 "
        f"{warm / b.dataset:.3f} (at most {b.warm / b.dataset:.3f}; target "
        f"{b.target / b.dataset:.3f})"
    )
    print(say)
    assert cold <= b.cold, say
    assert warm <= b.warm, say
