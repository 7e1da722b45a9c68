"""Every descriptor a dataset opens has an owner that closes it (issue "trust, second
round", item 14): datasets read in this process and closed, or dropped and collected,
leave the process's descriptor count where it was."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from pathlib import Path

import pytest

from asynccache import StreamingDataset
from asynccache.bridge import get_loop_thread
from tests.helpers import uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(300)

ITEMS = 24
ROUNDS = 50
# The I/O thread closes a collected dataset's connection (its sockets) after the
# collection: the count is looked at again until it settles, at most this often.
_SETTLE_TRIES = 200


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def _settled(baseline: dict[int, str]) -> dict[int, str]:
    """The descriptors opened since ``baseline`` once the I/O thread has closed what it
    was handed (polled: each try waits for a round trip through the loop, not a time)."""
    extra: dict[int, str] = {}
    for _ in range(_SETTLE_TRIES):
        gc.collect()
        get_loop_thread().call(_idle(), 30)
        now = _fds()
        extra = {fd: target for fd, target in now.items() if fd not in baseline}
        if not extra:
            return extra
        time.sleep(0.01)
    return extra


async def _idle() -> None:
    """One pass of the I/O thread's loop (what was posted before it has run)."""


def _read(url: str, cache: Path, opts: dict, *, shuffle: bool) -> StreamingDataset:
    ds = StreamingDataset(url, cache_dir=cache, storage_options=opts, shuffle=shuffle, seed=1)
    got = sorted(int(item["i"]) for item in ds)
    assert got == list(range(ITEMS))
    return ds


@pytest.fixture(scope="module")
def remote(objstore, tmp_path_factory):
    src = write_noise_dataset(tmp_path_factory.mktemp("src"), ITEMS, per_chunk=4, size=256)
    with uploaded(src, objstore, "fds") as url:
        yield url


@pytest.mark.parametrize("how", ["closed", "collected"])
def test_datasets_read_here_leave_no_descriptor(remote, objstore, tmp_path, how) -> None:
    opts = objstore.storage_options
    cache = tmp_path / "cache"
    # One read first: what a process keeps for good (its I/O thread, the shared gate)
    # is open before the count is taken.
    _read(remote, cache, opts, shuffle=True).close()
    baseline = _settled(_fds()) or _fds()
    for i in range(ROUNDS):
        ds = _read(remote, cache, opts, shuffle=bool(i % 2))
        if how == "closed":
            ds.close()
        del ds
    extra = _settled(baseline)
    assert not extra, f"{len(extra)} descriptors left open: {sorted(set(extra.values()))}"
