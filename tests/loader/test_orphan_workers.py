"""DataLoader workers end with the process that owns them, also under ``forkserver``.

Under ``forkserver`` a worker's parent is the fork server, which torch's own watchdog
watches instead of the process that owns the DataLoader, and the fork server lives as
long as the workers: killed outright, the owner used to leave both behind for good.
(Under ``fork`` and ``spawn`` the parent is the owner, and torch's watchdog sees it go.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.remote_data import write_dataset

_OWNER = """
import sys, time
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from asynccache import StreamingDataset

ds = StreamingDataset(sys.argv[1], batch_size=4)
loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                    multiprocessing_context=mp.get_context(sys.argv[2]))
it = iter(loader)
next(it)
print(*[w.pid for w in it._workers], flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(90)
def test_forkserver_workers_exit_when_their_owner_is_killed(tmp_path) -> None:
    method = "forkserver"
    src = write_dataset(tmp_path / "ds", 64, chunk_size=16)
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(src), method], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    try:
        workers = [int(p) for p in owner.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if _alive(p)], f"{method} workers outlived their owner"
    finally:
        owner.kill()
        owner.wait(timeout=10)
        owner.stdout.close()
