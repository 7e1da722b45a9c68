"""Staging directories: a killed worker's is removed by the next one, a live one's is kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from asynccache.optimize.staging import PREFIX, StagingDir, sweep_orphans

_HOLD = (
    "import sys, time\n"
    "from asynccache.optimize.staging import StagingDir\n"
    "d = StagingDir(sys.argv[1]); open(d.path + '/chunk-0-0.bin.tmp', 'wb').write(b'x')\n"
    "print(d.path, flush=True); time.sleep(60)\n"
)


def _holder(parent: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, parent], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_killed_owners_staging_is_swept_a_live_ones_kept(tmp_path) -> None:
    parent = str(tmp_path)
    dead, dead_dir = _holder(parent)
    live, live_dir = _holder(parent)
    foreign = tmp_path / f"{PREFIX}not-made-here"  # no owner file: never judged
    foreign.mkdir()
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=10)
        assert os.path.isdir(dead_dir)  # a killed worker cannot clean up
        mine = StagingDir(parent)  # the next worker sweeps on the way in
        try:
            assert not os.path.exists(dead_dir)
            assert os.path.isdir(live_dir) and os.path.isdir(foreign)
            assert sweep_orphans(parent) == []  # the live owner and we hold our locks
        finally:
            mine.close()
        assert not os.path.exists(mine.path)
    finally:
        live.kill()
        live.wait(timeout=10)
    assert sweep_orphans(parent) == [live_dir]
    assert sorted(os.listdir(parent)) == [foreign.name]


def test_a_forked_child_removes_nothing(tmp_path) -> None:
    d = StagingDir(str(tmp_path))
    pid = os.fork()
    if pid == 0:  # the child's copy of the object, closed in the child
        d.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.isdir(d.path)
    assert sweep_orphans(str(tmp_path)) == []  # the child did not take our lock away
    d.close()
    assert not os.path.exists(d.path)


def test_one_killed_before_it_locked_is_swept_by_the_pid_in_its_name(tmp_path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    orphan = tmp_path / f"{PREFIX}{gone.pid}-abc"  # made, never locked: no .owner
    orphan.mkdir()
    live = tmp_path / f"{PREFIX}{os.getppid()}-abc"  # a live pid, no .owner yet: kept
    live.mkdir()
    assert sweep_orphans(str(tmp_path)) == [str(orphan)]
    assert live.is_dir()
