"""A shuffle window the budget cannot hold shrinks to fit; the order stays seeded and
resumes exactly: the state names the window, a resume reads with it (whatever the new
budget would choose), and a budget too small for it is refused naming both windows.

Real S3 server, two DataLoader workers, states through ``CacheDataLoader``."""

from __future__ import annotations

import pickle
import uuid

import pytest

from asynccache import CacheDataLoader, ResumeStateError, StreamingDataset
from asynccache.read.readplan import EpochSpec, ReaderPlace, plan_minimum
from asynccache.sampling.order import OrderSpec
from tests.budget_data import Remote, write_remote

ITEMS = 1501  # 108 chunks of 14 items
BATCH, WORKERS, WINDOW, STOP = 8, 2, 4, 30
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory) -> Remote:
    src = tmp_path_factory.mktemp("window-src")
    return write_remote(objstore, str(src), f"window-{uuid.uuid4().hex[:8]}", ITEMS)


def minimum(remote: Remote, window: int) -> int:
    place = ReaderPlace(0, (), 0, 1, 0, WORKERS, 0, BATCH, False)
    return plan_minimum(remote.index, EpochSpec(place, OrderSpec(5, True, WINDOW)), window)


def loader(remote: Remote, objstore, cache, budget: int) -> CacheDataLoader:
    ds = StreamingDataset(
        remote.url,
        cache_dir=cache,
        shuffle=True,
        seed=5,
        shuffle_window=WINDOW,
        max_cache_bytes=budget,
        storage_options=objstore.storage_options,
    )
    return CacheDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def keys_of(batches) -> list[int]:
    return [k for b in batches for k in b["i"].tolist()]


def test_a_shrunk_window_is_seeded_and_resumes_with_the_states_window(remote, objstore, tmp_path):
    small = minimum(remote, 2)
    assert small < minimum(remote, WINDOW)
    # The window that fits: 2 (3 needs more, or is no larger).
    whole = loader(remote, objstore, tmp_path / "a", small)
    order = keys_of(whole)
    assert whole.dataset._order().spec.window == 2
    assert sorted(order) == list(range(ITEMS))
    again = loader(remote, objstore, tmp_path / "b", small)
    assert keys_of(again) == order, "seeded: the same order under the same budget"
    full = loader(remote, objstore, tmp_path / "c", minimum(remote, WINDOW) * 4)
    assert keys_of(full) != order  # the requested window is another order

    # Stopped after STOP batches, the state names the window read with.
    first = loader(remote, objstore, tmp_path / "d", small)
    head = []
    for i, b in enumerate(first):
        head.append(b)
        if i + 1 == STOP:
            break
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state["stream"]["window"] == 2
    assert keys_of(head) == order[: STOP * BATCH]
    # Resumed under a budget that would hold the whole window: the state's window.
    rest = loader(remote, objstore, tmp_path / "e", minimum(remote, WINDOW) * 4)
    rest.load_state_dict(state)
    assert keys_of(head) + keys_of(rest) == order
    # Under a budget that holds only window 1: refused, both windows named.
    tiny = loader(remote, objstore, tmp_path / "f", minimum(remote, 1))
    tiny.load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"shuffle_window 2.* shuffle_window 1"):
        next(iter(tiny))
    # A damaged window is refused when the state is loaded.
    bad = dict(state, stream=dict(state["stream"], window=WINDOW + 1))
    with pytest.raises(ResumeStateError, match="window"):
        loader(remote, objstore, tmp_path / "g", small).load_state_dict(bad)
