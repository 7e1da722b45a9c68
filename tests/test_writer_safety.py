"""The write path is as safe as the read path: one job per directory, durable commits,
damaged chunks caught at open, and a restart after a crash never mixes two writes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from asynccache.errors import CacheError, TruncatedChunkError, WriteConflictError
from asynccache.torch.cache import Cache
from asynccache.torch.dataloader import CacheDataLoader
from asynccache.torch.writepass import wait_for_index
from asynccache.write.writelock import LOCK_NAME, WriteLock, is_held
from tests.loader.datasets import DictDataset

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent

# A job that writes 6 items (3 chunks published), says "ready", and finishes its write
# (index.json) only when told to on stdin; "crash" makes it kill itself instead.
JOB = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from asynccache.torch.cache import Cache
    cache = Cache(sys.argv[1], chunk_size=2)
    for i in range(int(sys.argv[2])):
        cache[i] = {"x": np.full(4, 100 + i, dtype=np.int32)}
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    cache.done()
    print("done", flush=True)
    """
)


def _start_job(directory: Path, items: int = 6) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", JOB, str(directory), str(items)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _tell(proc: subprocess.Popen[str], line: str) -> int:
    proc.communicate(line + "\n", timeout=60)
    return proc.returncode


def test_second_job_is_refused_and_leaves_the_first_jobs_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _start_job(out)
    try:
        written = sorted(p.name for p in out.glob("chunk-*.bin"))
        assert written == ["chunk-0-0.bin", "chunk-0-1.bin"]  # the third is still buffered
        with pytest.raises(WriteConflictError, match=f"pid {job.pid}"):
            list(CacheDataLoader(DictDataset(6), cache_dir=out, batch_size=2))
        with pytest.raises(WriteConflictError, match=str(out)):
            Cache(out)[0] = 1
        assert sorted(p.name for p in out.glob("chunk-*.bin")) == written  # untouched
        assert _tell(job, "go") == 0
    finally:
        job.kill()
    cache = Cache(out)
    assert [int(cache[i]["x"][0]) for i in range(6)] == [100 + i for i in range(6)]
    assert not (out / LOCK_NAME).exists()  # a finished write leaves no lock file behind


def test_restart_after_a_crash_mid_write_never_mixes_writes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _start_job(out, items=10)
    assert _tell(job, "crash") == -signal.SIGKILL
    assert len(list(out.glob("chunk-*.bin"))) == 4  # the crashed write's chunks
    assert not is_held(str(out))  # the kernel dropped the dead job's lock

    cache = Cache(out, chunk_size=2)
    for i in range(3):
        cache[i] = {"x": np.full(4, 200 + i, dtype=np.int32)}
    index = cache.done()
    on_disk = sorted(p.name for p in out.glob("chunk-*.bin"))
    assert on_disk == sorted(c.filename for c in index.chunks)  # nothing of the old write
    again = Cache(out)
    assert [int(again[i]["x"][0]) for i in range(len(again))] == [200, 201, 202]


def _hold_until_told(directory: str, ready, stop) -> None:  # type: ignore[no-untyped-def]
    lock = WriteLock.acquire(directory, "other-job")
    ready.set()
    stop.wait(60)
    lock.release()


def test_a_rank_waiting_for_the_merge_fails_fast(tmp_path: Path) -> None:
    out = str(tmp_path)
    # Another job holds the directory: the index of our pass will never come.
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_until_told, args=(out, ready, stop))
    other.start()
    try:
        assert ready.wait(60)
        with pytest.raises(WriteConflictError, match="another job"):
            wait_for_index(out, "our-pass", 3600)
    finally:
        stop.set()
        other.join(60)
    # Rank 0 of our pass took the lock on this host and is gone without publishing.
    lock = WriteLock.acquire(out, "our-pass")
    with open(os.path.join(out, LOCK_NAME), "rb") as f:
        holder = f.read()
    lock.release()
    with open(os.path.join(out, LOCK_NAME), "wb") as f:
        f.write(holder)  # as a killed rank 0 leaves it: its record, nobody holding it
    assert socket.gethostname().encode() in holder
    with pytest.raises(CacheError, match="rank 0"):
        wait_for_index(out, "our-pass", 3600)


def _child_waits(stop) -> None:  # type: ignore[no-untyped-def]
    stop.wait(60)


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    lock = WriteLock.acquire(str(tmp_path), "t")
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    child = ctx.Process(target=_child_waits, args=(stop,))
    child.start()
    try:
        lock.release()
        assert not is_held(str(tmp_path))  # the child's copy of the descriptor is closed
        WriteLock.acquire(str(tmp_path), "next").release()
    finally:
        stop.set()
        child.join(60)


def test_workers_of_the_same_job_write_under_its_lock(tmp_path: Path) -> None:
    dl = CacheDataLoader(
        DictDataset(20), cache_dir=tmp_path, chunk_size=3, batch_size=2, num_workers=2
    )
    assert sorted(int(i) for b in dl for i in b["i"]) == list(range(20))
    assert len(Cache(tmp_path)) == 20 and not (tmp_path / LOCK_NAME).exists()


def test_chunks_and_writer_indexes_are_durable_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    cache = Cache(out, chunk_size=2)
    for i in range(7):
        cache[i] = i
    cache.done()
    monkeypatch.undo()

    commit = events.index(("replace", str(out / "index.json")))
    files = sorted(p.name for p in out.iterdir() if p.name != "index.json")
    sidecars = [n for n in files if n.startswith("index-") and n.endswith(".cols")]
    assert len(sidecars) == 1  # the index's columns: durable before the commit too
    assert files == ["0.index.json"] + [f"chunk-0-{n}.bin" for n in range(4)] + sidecars
    for name in files:
        renamed = events.index(("replace", str(out / name)))
        synced = [
            i
            for i, (kind, path) in enumerate(events)
            if kind == "fsync" and os.path.basename(path).startswith(f".{name}.")
        ]
        assert synced and synced[0] < renamed < commit, name  # data on disk, then named
    dir_syncs = [i for i, e in enumerate(events) if e == ("fsync", str(out))]
    assert any(i < commit for i in dir_syncs)  # the chunks' names before the commit
    assert any(i > commit for i in dir_syncs)  # and the commit itself


@pytest.mark.parametrize("damage", ["truncated", "replaced"])
def test_a_damaged_chunk_is_refused_when_the_cache_opens(tmp_path: Path, damage: str) -> None:
    list(CacheDataLoader(DictDataset(12), cache_dir=tmp_path, chunk_size=4, batch_size=4))
    chunk = tmp_path / "chunk-0-2.bin"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:100] if damage == "truncated" else data + data[:64])
    with pytest.raises(TruncatedChunkError, match="chunk-0-2.bin.*delete"):
        Cache(tmp_path)[0]  # chunk 0 itself is fine: the whole dataset is refused at once
    with pytest.raises(TruncatedChunkError, match="chunk-0-2.bin"):
        CacheDataLoader(DictDataset(12), cache_dir=tmp_path, batch_size=4)
