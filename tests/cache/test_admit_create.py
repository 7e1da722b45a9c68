"""A reservation admits under the eviction lock, then creates outside it (issue 17, part 2).

Under the cache-wide lock only the decision and the ledger: the bytes, and the file as a
pending entry that every scan counts at its admitted size. The file is created before the
lock and preallocated after it. The ledger must stay exact through any interleaving of two
stores' steps (a file created, admitted, preallocated or found full, published, removed
unused, or left by a writer that died), the budget must hold whenever something could be
evicted, and a full disk must raise the same error as before. And the fork-safe descriptor
registry no longer holds its mutex across ``open``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asynccache.bridge import forksafe
from asynccache.cache import ChunkStore, usage
from asynccache.cache.layout import TempFile
from asynccache.cache.locks import open_lock_file, try_lock
from asynccache.cache.plan import Deferred
from asynccache.errors import DiskFullError

pytestmark = pytest.mark.timeout(120)

UNIT = 4096
BUDGET = 6 * UNIT
_BOUND_S = 30.0
_FULL = "is full: {} more bytes do not fit even after evicting every unpinned chunk"


class _Locked:
    """The eviction lock, held exclusively (the steps run one at a time: never waits)."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache

    def __enter__(self) -> int:
        self.fd = open_lock_file(str(self.cache / ".evict.lock"))
        assert try_lock(self.fd, exclusive=True)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        forksafe.close_fd(self.fd)


class Interleavings(RuleBasedStateMachine):
    """Two stores sharing one cache, stepping through reservations in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = Path(tempfile.mkdtemp(prefix="asynccache-admit-"))
        self.stores = [
            ChunkStore(self.cache / f"ds{i}", max_cache_bytes=BUDGET, durable=False)
            for i in range(2)
        ]
        self.n = 0
        self.created: list[tuple[ChunkStore, TempFile]] = []  # not admitted yet
        self.admitted: list[tuple[ChunkStore, TempFile]] = []  # not preallocated yet
        self.allocated: list[tuple[ChunkStore, TempFile]] = []
        self.full_errors = 0

    def teardown(self) -> None:
        for _, tmp in self.created + self.admitted + self.allocated:
            tmp.discard()
        for store in self.stores:
            store.close()
        shutil.rmtree(self.cache, ignore_errors=True)

    def _take(self, pool: list[tuple[ChunkStore, TempFile]], i: int) -> tuple[ChunkStore, TempFile]:
        return pool.pop(i % len(pool))

    @rule(which=st.integers(0, 1), units=st.integers(1, 3))
    def create(self, which: int, units: int) -> None:
        store = self.stores[which]
        self.n += 1
        self.created.append((store, store._create(f"chunk-{which}-{self.n}.bin", units * UNIT)))

    @rule(which=st.integers(0, 1), units=st.integers(1, 3), spare=st.booleans())
    def reserve_at_once(self, which: int, units: int, spare: bool) -> None:
        # The lock is free: created, admitted and preallocated on one thread.
        store = self.stores[which]
        self.n += 1
        name = f"chunk-{which}-{self.n}.bin"
        try:
            tmp, state = store._try_now(name, units * UNIT, False, spare)
        except Deferred:
            assert spare  # a file made ahead only into room the cache has
            assert not list(store.root.glob(f".{name}.*"))
            return
        assert state == "allocated"
        self.allocated.append((store, tmp))

    @precondition(lambda self: self.created)
    @rule(i=st.integers(0, 7))
    def admit(self, i: int) -> None:
        store, tmp = self._take(self.created, i)
        with _Locked(self.cache) as fd:
            store._reserve_locked(fd, tmp.final.name, tmp)
        self.admitted.append((store, tmp))
        published = sum(e.size for e in usage.scan(self.cache)[1])
        # Over budget only when nothing published is left to evict.
        assert self._truth() <= BUDGET or published == 0

    @precondition(lambda self: self.admitted)
    @rule(i=st.integers(0, 7), full=st.booleans())
    def allocate(self, i: int, full: bool) -> None:
        store, tmp = self._take(self.admitted, i)
        if not full:
            tmp.allocate()
            self.allocated.append((store, tmp))
            return
        real = os.posix_fallocate

        def enospc(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.posix_fallocate = enospc  # the disk fills before this file's blocks are taken
        try:
            with pytest.raises(DiskFullError):
                tmp.allocate()
            with _Locked(self.cache) as fd, pytest.raises(DiskFullError) as info:
                store._allocate_locked(fd, tmp)
        finally:
            os.posix_fallocate = real
        assert _FULL.format(tmp.size) in str(info.value)
        assert str(store.root) in str(info.value)
        assert not tmp.path.exists()
        self.full_errors += 1

    @precondition(lambda self: self.allocated)
    @rule(i=st.integers(0, 7))
    def publish(self, i: int) -> None:
        _, tmp = self._take(self.allocated, i)
        tmp.publish()

    @precondition(lambda self: self.admitted or self.allocated)
    @rule(i=st.integers(0, 7), allocated=st.booleans())
    def discard(self, i: int, allocated: bool) -> None:
        pool = self.allocated if allocated and self.allocated else self.admitted or self.allocated
        _, tmp = self._take(pool, i)
        assert tmp.discard()

    @precondition(lambda self: self.created or self.admitted or self.allocated)
    @rule(i=st.integers(0, 7), where=st.integers(0, 2))
    def writer_dies(self, i: int, where: int) -> None:
        pools = [p for p in (self.created, self.admitted, self.allocated) if p]
        _, tmp = self._take(pools[where % len(pools)], i)
        assert tmp.fd is not None
        forksafe.close_fd(tmp.fd)  # its flock goes, its file stays: what a crash leaves
        tmp.fd = None

    @rule()
    def ledger_ages(self) -> None:
        # The next reservation rescans (and evicts): scans then meet pending files.
        with _Locked(self.cache) as fd:
            ledger = usage.read_ledger(fd)
            if ledger is not None:
                usage.write_ledger(fd, ledger.used, usage.RESCAN_EVERY, ledger.scanned_at)

    def _truth(self) -> int:
        """What the cache holds: chunks, plus each temporary file of a live writer at its
        admitted size (when admitted) or what it holds."""
        held = 0
        pending = {str(t.path): t.size for _, t in self.admitted + self.allocated}
        for root in (s.root for s in self.stores):
            for f in os.scandir(root):
                if f.name.startswith("chunk-"):
                    held += f.stat().st_size
                elif f.name.endswith(".tmp"):
                    held += max(f.stat().st_size, pending.get(f.path, 0))
        return held

    @invariant()
    def ledger_is_exact(self) -> None:
        with _Locked(self.cache) as fd:
            settled = usage.settle(fd, self.cache)  # what the next holder of the lock sees
            if settled.ledger is None:
                return  # nothing admitted yet
            assert settled.ledger.used == self._truth()
            live = {(s, str(t.path)) for s, t in self.admitted + self.allocated}
            assert {e.resolve(self.cache) for e in settled.pending} == {p for _, p in live}
            assert not any(os.path.isabs(e.path) for e in settled.pending)  # other mounts
            assert settled.unallocated == sum(t.size for _, t in self.admitted)


def test_ledger_exact_over_interleavings() -> None:
    run_state_machine_as_test(
        Interleavings,
        settings=settings(
            max_examples=40,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


async def _reserve(store: ChunkStore, name: str) -> TempFile:
    return await store.reserve(name, UNIT)


def test_preallocation_runs_outside_the_eviction_lock(tmp_path, monkeypatch) -> None:
    """While one reservation's preallocation waits (a journal commit on ext4), another
    store's reservation is admitted and done: the lock is not held across it."""
    import asyncio

    a = ChunkStore(tmp_path / "a", max_cache_bytes=BUDGET, cache_dir=tmp_path)
    b = ChunkStore(tmp_path / "b", max_cache_bytes=BUDGET, cache_dir=tmp_path)
    entered, release = threading.Event(), threading.Event()
    real = os.posix_fallocate

    def slow(fd: int, offset: int, length: int) -> None:
        if "/a/" in os.readlink(f"/proc/self/fd/{fd}"):
            entered.set()
            assert release.wait(_BOUND_S)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow)
    got: list[TempFile] = []
    first = threading.Thread(target=lambda: got.append(asyncio.run(_reserve(a, "chunk-0-0.bin"))))
    first.start()
    try:
        assert entered.wait(_BOUND_S)
        # The first reservation sits in its preallocation: the lock must be free.
        lock = open_lock_file(str(tmp_path / ".evict.lock"))
        try:
            assert try_lock(lock, exclusive=True), "the eviction lock is held across fallocate"
            fcntl.flock(lock, fcntl.LOCK_UN)
        finally:
            forksafe.close_fd(lock)
        other: list[TempFile] = []
        side = threading.Thread(
            target=lambda: other.append(asyncio.run(_reserve(b, "chunk-1-0.bin")))
        )
        side.start()
        side.join(_BOUND_S)
        assert other and not side.is_alive()
        # Both counted, the first one pending at its size though it holds nothing yet.
        with _Locked(tmp_path) as fd:
            settled = usage.settle(fd, tmp_path)
            assert settled.ledger is not None and settled.ledger.used == 2 * UNIT
            assert settled.unallocated == UNIT
        other[0].discard()
    finally:
        release.set()
        first.join(_BOUND_S)
    assert got and os.fstat(got[0].fd).st_size == UNIT
    got[0].discard()


def test_open_does_not_hold_the_registry_mutex(tmp_path) -> None:
    """An open that blocks (here: a FIFO with no writer yet; on ext4: a create waiting
    for a journal commit) does not hold up other threads' tracked opens and closes."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    opened: list[int] = []
    blocked = threading.Thread(target=lambda: opened.append(forksafe.open_fd(fifo, os.O_RDONLY)))
    blocked.start()
    try:
        done: list[int] = []
        other = threading.Thread(
            target=lambda: done.append(forksafe.open_fd(tmp_path / "x", os.O_RDWR | os.O_CREAT))
        )
        other.start()
        other.join(_BOUND_S)
        assert done, "a tracked open waited for another thread's blocked open"
        assert not opened  # the FIFO's open is still blocked
        forksafe.close_fd(done[0])
    finally:
        w = os.open(fifo, os.O_WRONLY)  # lets the reader's open return
        blocked.join(_BOUND_S)
        os.close(w)
    assert opened and opened[0] in forksafe.tracked_fds()
    forksafe.close_fd(opened[0])


def test_fork_during_open_leaves_the_child_no_lock(tmp_path, monkeypatch) -> None:
    """A fork lands between ``os.open`` returning and the descriptor being tracked: the
    child's copy must not keep a flock the parent takes later alive."""
    path = str(tmp_path / "x.lock")
    real = os.open
    child_copy: list[int] = []

    def open_then_fork(p, flags, mode=0o777, **kw):  # type: ignore[no-untyped-def]
        fd = real(p, flags, mode, **kw)
        if p == path and not child_copy:
            # What a fork at this moment does: the registry's fork hooks run, and the
            # child holds a copy sharing this open file description.
            forksafe._registry.before_fork()
            child_copy.append(os.dup(fd))
            forksafe._registry.after_fork_in_parent()
        return fd

    monkeypatch.setattr(os, "open", open_then_fork)
    fd = forksafe.open_fd(path, os.O_RDWR | os.O_CREAT)
    monkeypatch.setattr(os, "open", real)
    assert child_copy and fd in forksafe.tracked_fds()
    fcntl.flock(fd, fcntl.LOCK_EX)
    forksafe.close_fd(fd)  # the parent lets go
    other = real(path, os.O_RDWR)
    try:
        assert try_lock(other, exclusive=True), "the child's copy keeps the parent's lock"
    finally:
        os.close(other)
        os.close(child_copy[0])


def test_child_forked_during_open_closes_its_copy(tmp_path, monkeypatch) -> None:
    """A real fork lands between ``os.open`` returning and the descriptor being tracked:
    the child must not keep the copy it inherited (it would hold the file open, and a
    deleted temporary file's space with it, for the child's whole life)."""
    path = str(tmp_path / "y.tmp")
    real = os.open
    pids: list[int] = []

    def open_then_fork(p, flags, mode=0o777, **kw):  # type: ignore[no-untyped-def]
        fd = real(p, flags, mode, **kw)
        if p == path and not pids:
            pid = os.fork()
            if pid == 0:  # the child: is the copy still open once the fork hooks ran?
                try:
                    os.fstat(fd)
                except OSError:
                    os._exit(0)
                os._exit(3)
            pids.append(pid)
        return fd

    monkeypatch.setattr(os, "open", open_then_fork)
    fd = forksafe.open_fd(path, os.O_RDWR | os.O_CREAT)
    monkeypatch.setattr(os, "open", real)
    try:
        assert pids and fd in forksafe.tracked_fds()
        deadline = time.monotonic() + _BOUND_S
        while True:
            pid, status = os.waitpid(pids[0], os.WNOHANG)
            if pid or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert pid, "the child did not exit"
        assert os.waitstatus_to_exitcode(status) == 0, "the child kept its copy open"
        # The parent's own descriptor is untouched.
        assert os.fstat(fd).st_ino == os.stat(path).st_ino
    finally:
        forksafe.close_fd(fd)
