"""The single-job lease never compares two hosts' wall clocks.

A contender whose clock runs 120 s ahead of (or behind) the holder's must judge the lease
by what it sees change over its own monotonic time: a live job's lease changes within the
lease period (refuse), a dead job's does not (take over once the period is over). The
storage is the real S3 server; the skewed clock is injected as the ``time`` module the
lease code reads, so monotonic time and sleeps stay real.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import types
import uuid

import pytest

from asynccache import StreamingDataset, WriteConflictError, optimize
from asynccache.config import Settings
from asynccache.optimize import job as jobs
from asynccache.optimize.job import LEASE_KEY, Lease, call, get_json, put_bytes
from asynccache.storage import open_storage
from tests.optimize import helpers
from tests.optimize.test_resume import N, keys, start_job, wait_for

QUIET = Settings.from_env(progress=False)
SKEW_S = 120.0
#: A short lease for the Lease-level tests (the product's is LEASE_TTL_S).
TTL_S = 2.0
pytestmark = pytest.mark.timeout(240)


class SkewedTime(types.ModuleType):
    """The ``time`` module of a host whose wall clock is ``offset_s`` off; the rest real."""

    def __init__(self, offset_s: float) -> None:
        super().__init__("time")
        self.offset_s = offset_s

    def time(self) -> float:
        return time.time() + self.offset_s

    def __getattr__(self, name: str):
        return getattr(time, name)


class ForeignHolder:
    """A job on another host holding the lease: its own document, rewritten every
    ``every_s`` with its own (skewed) wall clock while :attr:`alive`, never after."""

    def __init__(self, storage, offset_s: float, every_s: float) -> None:
        self.storage, self.offset_s, self.every_s = storage, offset_s, every_s
        self.owner = "holder-" + uuid.uuid4().hex[:8]
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-foreign-lease", daemon=True)

    def doc(self) -> bytes:
        self.beats += 1
        return json.dumps(
            {
                "owner": self.owner,
                "pid": 1,
                "host": "elsewhere.invalid",
                "heartbeat": time.time() + self.offset_s,
                "beat": self.beats,
            }
        ).encode()

    def write(self) -> None:
        call(put_bytes(self.storage, LEASE_KEY, self.doc()))

    def start(self) -> ForeignHolder:
        self.write()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.fixture
def storage(objstore, bucket):
    s = open_storage(f"s3://{bucket}/ds", QUIET, objstore.storage_options)
    try:
        yield s
    finally:
        call(s.close())


@pytest.mark.parametrize("offset_s", [-SKEW_S, SKEW_S], ids=["contender-ahead", "contender-behind"])
def test_a_live_lease_on_another_host_is_refused_whatever_the_clocks(
    storage, offset_s, caplog
) -> None:
    holder = ForeignHolder(storage, offset_s, every_s=TTL_S / 8).start()
    try:
        contender = Lease(storage, "contender", ttl_s=TTL_S)
        with (
            caplog.at_level(logging.WARNING, logger=jobs.__name__),
            pytest.raises(WriteConflictError, match="is converting a dataset into this output"),
        ):
            contender.acquire()
        assert not [r for r in caplog.records if "taking over" in r.getMessage()]
        doc = call(get_json(storage, LEASE_KEY))
        assert doc is not None and doc["owner"] == holder.owner
    finally:
        holder.stop()


@pytest.mark.parametrize("offset_s", [-SKEW_S, SKEW_S], ids=["contender-ahead", "contender-behind"])
def test_a_dead_lease_on_another_host_is_taken_over_after_the_period(
    storage, offset_s, caplog
) -> None:
    ForeignHolder(storage, offset_s, every_s=TTL_S).write()  # written once, then silence
    contender = Lease(storage, "contender", ttl_s=TTL_S)
    with caplog.at_level(logging.WARNING, logger=jobs.__name__):
        contender.acquire()
    try:
        doc = call(get_json(storage, LEASE_KEY))
        assert doc is not None and doc["owner"] == "contender"
        assert any("taking over the stale lease" in r.getMessage() for r in caplog.records)
    finally:
        contender.release()
    assert LEASE_KEY not in [o.key for o in call(storage.list())]


def test_a_contender_whose_clock_runs_ahead_leaves_a_live_job_alone(
    objstore, bucket, tmp_path, monkeypatch
) -> None:
    """A whole job (another process) converting; a second optimize on this "host", whose
    clock runs 120 s ahead, must refuse, and the first job's output must be its own."""
    url, so = f"s3://{bucket}/ds", objstore.storage_options
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    live = start_job(url, so, log_dir, "gate", workers=0)  # waits at its inputs for "go"
    try:
        wait_for(lambda: LEASE_KEY in keys(url, so), "the live job's lease")
        monkeypatch.setattr(jobs, "time", SkewedTime(SKEW_S))
        with pytest.raises(WriteConflictError, match="is converting a dataset into this output"):
            optimize(helpers.tag, [("B", i) for i in range(N)], url, num_workers=0,
                     storage_options=so, settings=QUIET)  # fmt: skip
        monkeypatch.undo()
    finally:
        open(os.path.join(log_dir, "go"), "w").close()
        live.wait(180)
    assert live.returncode == 0
    ds = StreamingDataset(url, cache_dir=str(tmp_path / "c"), storage_options=so)
    try:
        items = [ds[k] for k in range(len(ds))]
    finally:
        ds.close()
    assert [int(x["i"]) for x in items] == list(range(N))
    assert not [x for x in items if "name" in x], "the contender's items reached the output"
