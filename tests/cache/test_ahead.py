"""Temporary files made ahead of their downloads (``ChunkStore.reserve_ahead``).

A file made ahead is a reservation like any other: counted in the ledger while it exists
and taken off exactly when it is removed unused; locked by its process (swept once that
process is gone, never kept alive by a child); published only by a download that fills
and verifies it; never made by evicting.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import pytest
from fork_support import live_child
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccache.bridge import forksafe
from asynccache.cache import ChunkStore, sweep_orphans, usage
from asynccache.cache.locks import open_lock_file

pytestmark = pytest.mark.timeout(60)

SIZE = 4096
NAMES = [f"chunk-0-{i}.bin" for i in range(5)]


def _ledger(store: ChunkStore) -> int:
    fd = open_lock_file(str(store.cache_dir / ".evict.lock"))
    try:
        ledger = usage.read_ledger(fd)
    finally:
        forksafe.close_fd(fd)  # tracked: a plain close would leave its number tracked
    assert ledger is not None
    return ledger.used


def _temps(store: ChunkStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir() if p.name.endswith(".tmp"))


def test_made_ahead_counts_then_goes_off_the_ledger_exactly(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    asyncio.run(store.make_room(0))  # a full scan: the ledger starts exact (0)
    assert asyncio.run(store.reserve_ahead(NAMES[0], SIZE))
    assert store.ready_ahead() == {NAMES[0]}
    assert len(_temps(store)) == 1 and _ledger(store) == SIZE == store.used_bytes()
    assert asyncio.run(store.release_ahead(frozenset())) == 1
    assert _temps(store) == [] and _ledger(store) == 0 == store.used_bytes()
    assert not store.is_cached(NAMES[0])


def test_taken_file_is_published_by_its_download_only(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    assert asyncio.run(store.reserve_ahead(NAMES[0], SIZE))
    assert asyncio.run(store.take_ahead(NAMES[0], SIZE + 1)) is None  # not this chunk's size
    assert _temps(store) == [] and store.ready_ahead() == frozenset()
    assert asyncio.run(store.reserve_ahead(NAMES[0], SIZE))
    tmp = asyncio.run(store.take_ahead(NAMES[0], SIZE))
    assert tmp is not None and store.ready_ahead() == frozenset()
    assert not store.is_cached(NAMES[0])  # nothing appears until it is filled and published
    tmp.pwrite(b"v" * SIZE, 0)
    tmp.publish()
    assert store.path(NAMES[0]).read_bytes() == b"v" * SIZE


def test_nothing_is_evicted_to_make_a_file_ahead(tmp_path) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=2 * SIZE)
    for name in NAMES[:2]:
        tmp = store.create_temp(name, SIZE)
        tmp.pwrite(b"x" * SIZE, 0)
        tmp.publish()
    assert not asyncio.run(store.reserve_ahead(NAMES[2], SIZE))  # no room without evicting
    assert store.is_cached(NAMES[0]) and store.is_cached(NAMES[1]) and _temps(store) == []
    assert _ledger(store) == 2 * SIZE


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    moves=st.lists(
        st.tuples(
            st.sets(st.sampled_from(NAMES), max_size=3),  # the hint: files made ahead for it
            st.sampled_from([None, *NAMES]),  # a download that starts and publishes
        ),
        min_size=1,
        max_size=6,
    )
)
def test_ledger_is_exact_across_moved_hints(tmp_path_factory, moves) -> None:
    store = ChunkStore(tmp_path_factory.mktemp("c") / "ds", max_cache_bytes=1 << 20)

    async def run() -> None:
        await store.make_room(0)
        for hinted, started in moves:
            await store.release_ahead(frozenset(hinted))  # the hint moved on
            for name in sorted(hinted):
                if not store.is_cached(name):
                    assert await store.reserve_ahead(name, SIZE)
            if started is not None and not store.is_cached(started):
                tmp = await store.take_ahead(started, SIZE) or await store.reserve(started, SIZE)
                tmp.pwrite(b"p" * SIZE, 0)
                tmp.publish()
            assert _ledger(store) == store.used_bytes()  # exact, files made ahead included
        store.close()  # releases what is left, with its bytes

    asyncio.run(run())
    assert _temps(store) == [] and _ledger(store) == store.used_bytes()


def _make_ahead_then_die(root: str, out: object) -> None:
    store = ChunkStore(root, max_cache_bytes=1 << 20)
    made = asyncio.run(store.reserve_ahead("chunk-0-0.bin", SIZE))
    out.put((made, _temps(store)))  # type: ignore[attr-defined]
    os._exit(0)  # dies holding it: no close, no release


def test_made_ahead_file_of_a_dead_process_is_swept_never_published(tmp_path) -> None:
    root = tmp_path / "ds"
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=_make_ahead_then_die, args=(str(root), out))
    proc.start()
    made, names = out.get()
    proc.join(30)
    assert proc.exitcode == 0 and made and len(names) == 1
    assert (root / names[0]).exists()  # left behind by the dead process
    store = ChunkStore(root, max_cache_bytes=1 << 20)  # opening the store sweeps orphans
    assert not (root / names[0]).exists()
    assert not store.is_cached("chunk-0-0.bin")


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_children_do_not_hold_files_made_ahead(tmp_path, method) -> None:
    store = ChunkStore(tmp_path / "ds", max_cache_bytes=1 << 20)
    assert asyncio.run(store.reserve_ahead(NAMES[0], SIZE))
    (name,) = _temps(store)
    tmp = store._ready[NAMES[0]]
    with live_child(multiprocessing.get_context(method)) as child:
        tmp._close()  # the parent lets go without removing it, as if it died
        assert sweep_orphans(store.root) == [name]  # no child keeps its lock alive
        assert child.is_alive()


def test_no_file_ahead_under_a_plan_whose_dataset_does_not_fit(tmp_path) -> None:
    from test_plan import SIZE as CHUNK
    from test_plan import policy, two_readers

    plan = policy(two_readers(), [0, 0])  # 6 chunks, at least 3 at once
    small = ChunkStore(tmp_path / "a", max_cache_bytes=8 * CHUNK)
    small.policy = plan  # the prefetch room decides: 5 chunks of room, 6 to read
    assert not asyncio.run(small.reserve_ahead(NAMES[1], CHUNK)) and _temps(small) == []
    whole = ChunkStore(tmp_path / "b", max_cache_bytes=9 * CHUNK)
    whole.policy = plan  # the whole dataset fits beside the minimum
    assert asyncio.run(whole.reserve_ahead(NAMES[1], CHUNK)) and len(_temps(whole)) == 1
    whole.close()
