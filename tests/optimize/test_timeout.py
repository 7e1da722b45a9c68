"""optimize(input_timeout_s=...): a hung fn ends the job, naming the input; every wait bounded."""

from __future__ import annotations

import os

import pytest

from asynccache import ConfigError, InputFailedError, InputTimeoutError, optimize
from asynccache.config import Settings
from asynccache.optimize import watch
from tests.optimize import helpers

QUIET = Settings.from_env(progress=False)
pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hung_fn_stops_the_job_naming_the_input_and_kills_its_worker(tmp_path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    out, staging = tmp_path / "out", tmp_path / "staging"
    staging.mkdir()
    inputs = [(i, str(log_dir)) for i in range(8)]
    with pytest.raises(
        InputTimeoutError, match=r"more than 0.5s on input #3 \(\(3, .*\)\) in shard 1"
    ) as err:
        optimize(helpers.hang_on_3, inputs, str(out), num_workers=1, num_shards=4,
                 input_timeout_s=0.5, staging_dir=str(staging), settings=QUIET)  # fmt: skip
    assert isinstance(err.value, InputFailedError) and isinstance(err.value, TimeoutError)
    pid = int((log_dir / "hung").read_text())  # the fault fired: input 3 was hanging
    assert not _alive(pid), "the hung worker must be killed"
    assert not (out / "index.json").exists()
    assert os.listdir(staging) == []  # the call's staging directory went with it


def test_storage_waits_do_not_count_as_fn_time():
    """A worker waiting for the staging bound pauses its input's clock."""
    slots = [watch.IDLE, 0.0]
    clock = watch.InputClock(slots, 0)
    clock.begin(7)
    started = slots[1]
    with clock.paused():
        assert watch.overdue(slots, 0.0, now=started + 1e6) is None  # paused: not fn's time
    assert slots[0] == 7 and slots[1] >= started
    assert watch.overdue(slots, 10.0, now=slots[1] + 11)[0] == 7
    assert watch.overdue(slots, 10.0, now=slots[1] + 9) is None
    clock.end()
    assert watch.overdue(slots, 0.0, now=started + 1e6) is None


def test_input_timeout_needs_worker_processes(tmp_path):
    with pytest.raises(ConfigError, match="num_workers >= 1"):
        optimize(helpers.items, [1], str(tmp_path / "o"), num_workers=0, input_timeout_s=5,
                 settings=QUIET)  # fmt: skip
    with pytest.raises(ConfigError, match="input_timeout_s"):
        optimize(helpers.items, [1], str(tmp_path / "o"), num_workers=1, input_timeout_s=0,
                 settings=QUIET)  # fmt: skip


def test_rank_0_raises_another_ranks_timeout_and_keeps_the_finished_shards(tmp_path, monkeypatch):
    """Rank 0 of 2 (here: this process, its group stood in by ``_world``) gets rank 1's
    timeout marker while it waits for rank 1's shards: the same InputTimeoutError, and
    nothing discarded (a raising fn's marker would discard the job)."""
    from asynccache.optimize import api

    out = str(tmp_path / "out")
    monkeypatch.setattr(api, "_world", lambda: (0, 2, lambda v: v))
    posted: list[str] = []

    def fn(i: int):
        if not posted:  # rank 1 reports its hung input, as its driver does
            job = api.Job(out, _gen(out), "", 8, 4, "", 1, None, "create")
            api._post_failure(job, 1, f"{out}: fn ran for more than 1s on input #7", "timeout")
            posted.append(job.gen)
        return {"i": i}

    with pytest.raises(InputTimeoutError, match="more than 1s on input #7"):
        optimize(fn, list(range(8)), out, num_workers=0, num_shards=4, settings=QUIET)
    assert posted  # the marker was posted
    work = os.path.join(out, "_optimize", posted[0])
    kept = sorted(n for n in os.listdir(work) if n.startswith("shard-"))
    assert kept == ["shard-000000.index.json", "shard-000002.index.json"]  # rank 0's shards
    assert not os.path.exists(os.path.join(out, "index.json"))


def _gen(out: str) -> str:
    import json

    with open(os.path.join(out, "_optimize", "job.json")) as f:
        return json.load(f)["gen"]
