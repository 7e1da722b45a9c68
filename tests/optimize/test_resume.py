"""optimize() after kill -9 (whole job, one worker), and against a concurrent job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from asynccache import StreamingDataset, WorkerDiedError, WriteConflictError, optimize
from asynccache.config import Settings
from asynccache.optimize.job import LEASE_KEY, WORK_PREFIX, call, put_bytes
from asynccache.storage import open_storage
from tests.optimize import helpers

QUIET = Settings.from_env(progress=False)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, SHARDS = 80, 8  # shard k holds inputs 10k .. 10k+9; input 30 is in shard 3
pytestmark = pytest.mark.timeout(180)


def keys(url: str, so) -> list[str]:
    storage = open_storage(url, QUIET, so)
    try:
        return [o.key for o in call(storage.list())]
    finally:
        call(storage.close())


def finished_shards(url: str, so) -> set[int]:
    return {
        int(k.rsplit("shard-", 1)[1].split(".")[0])
        for k in keys(url, so)
        if k.startswith(WORK_PREFIX + "/") and k.endswith(".index.json")
    }


def wait_for(cond, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_job(url: str, so, log_dir: str, mode: str, workers: int) -> subprocess.Popen:
    args = dict(url=url, storage_options=so, log_dir=log_dir, mode=mode, n=N, workers=workers,
                shards=SHARDS)  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "tests.optimize.job_main", json.dumps(args)],
        cwd=ROOT,
        start_new_session=True,  # its own process group: kill -9 takes the workers too
    )


def rerun(url: str, so, log_dir: str, mode: str, workers: int):
    inputs = [(i, log_dir, mode) for i in range(N)]
    return optimize(helpers.logged, inputs, url, num_workers=workers, num_shards=SHARDS,
                    chunk_bytes=4096, storage_options=so, settings=QUIET)  # fmt: skip


def check_once(url: str, so, cache_dir) -> None:
    ds = StreamingDataset(url, cache_dir=str(cache_dir), storage_options=so)
    try:
        assert [int(ds[k]["i"]) for k in range(len(ds))] == list(range(N))
    finally:
        ds.close()


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_9_of_the_whole_job_then_rerun_resumes(objstore, bucket, tmp_path):
    url, so = f"s3://{bucket}/ds", objstore.storage_options
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    open(os.path.join(log_dir, "hang"), "w").close()
    proc = start_job(url, so, log_dir, "hang", workers=1)
    try:
        # shards 0-2 finish, then shard 3 hangs on input 30: the job is killed there
        wait_for(lambda: os.path.exists(os.path.join(log_dir, "hanging")), "input 30")
        wait_for(lambda: len(finished_shards(url, so)) == 3, "3 finished shards")
        worker = int(next(n for n in os.listdir(log_dir) if n.startswith("ran-"))[4:])
        assert running(worker)
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: its worker must follow it
        proc.wait(30)
        wait_for(lambda: not running(worker), "the worker to exit after its driver")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the rest of its group (fork server)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert "index.json" not in keys(url, so)
    done = finished_shards(url, so)
    first_pids = {n for n in os.listdir(log_dir) if n.startswith("ran-")}
    os.unlink(os.path.join(log_dir, "hang"))
    res = rerun(url, so, log_dir, "hang", workers=0)
    assert res.resumed_shards == 3
    again = []
    for name in os.listdir(log_dir):
        if name.startswith("ran-") and name not in first_pids:
            with open(os.path.join(log_dir, name)) as f:
                again += [int(x) for x in f.read().split()]
    assert sorted(again) == list(range(30, N)), "rerun must redo shards 3-7 only"
    assert done == {0, 1, 2}
    check_once(url, so, tmp_path / "c")
    assert not [k for k in keys(url, so) if k.startswith(WORK_PREFIX)]


def test_kill_9_of_one_worker_fails_clearly_and_rerun_resumes(objstore, bucket, tmp_path):
    url, so = f"s3://{bucket}/ds", objstore.storage_options
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    open(os.path.join(log_dir, "die"), "w").close()
    with pytest.raises(WorkerDiedError, match="rerun with the same arguments"):
        rerun(url, so, log_dir, "die", workers=1)
    done = finished_shards(url, so)
    # one worker, shards in order: it died in shard 3; shard 2 was finishing beside it
    assert {0, 1} <= done <= {0, 1, 2}
    first = set(os.listdir(log_dir))
    os.unlink(os.path.join(log_dir, "die"))
    res = rerun(url, so, log_dir, "die", workers=0)
    assert res.resumed_shards == len(done)
    again = []
    for name in set(os.listdir(log_dir)) - first:
        with open(os.path.join(log_dir, name)) as f:
            again += [int(x) for x in f.read().split()]
    assert not [i for i in again if i // 10 in done], "finished shards were redone"
    check_once(url, so, tmp_path / "c")


def test_a_second_job_on_the_same_output_gets_a_clear_error(objstore, bucket, tmp_path):
    url, so = f"s3://{bucket}/ds", objstore.storage_options
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    first: dict = {}

    def run_first() -> None:  # a job of its own (own owner token), waiting at its inputs
        try:
            first["result"] = rerun(url, so, log_dir, "gate", workers=0)
        except BaseException as exc:
            first["error"] = exc

    t = threading.Thread(target=run_first)
    t.start()
    try:
        wait_for(lambda: LEASE_KEY in keys(url, so), "the first job's lease")
        with pytest.raises(WriteConflictError, match=f"pid {os.getpid()} on .* is converting"):
            rerun(url, so, log_dir, "other", workers=0)
    finally:
        open(os.path.join(log_dir, "go"), "w").close()
        t.join(120)
    assert not t.is_alive() and "error" not in first, first
    check_once(url, so, tmp_path / "c")  # the first job's dataset, whole


def test_a_job_whose_lease_was_taken_over_does_not_commit(objstore, bucket, tmp_path):
    url, so = f"s3://{bucket}/ds", objstore.storage_options
    storage = open_storage(url, QUIET, so)
    thief = json.dumps({"owner": "other", "pid": 1, "host": "elsewhere", "heartbeat": time.time()})

    def steal(i: int):
        if i == 3:  # another job writes its lease while this one runs
            call(put_bytes(storage, LEASE_KEY, thief.encode()))
        return {"i": i}

    try:
        with pytest.raises(WriteConflictError, match="without committing"):
            optimize(steal, list(range(6)), url, num_workers=0, storage_options=so, settings=QUIET)
    finally:
        call(storage.close())
    assert "index.json" not in keys(url, so)
