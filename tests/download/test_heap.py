"""heap.trim gives back the pages of freed download pieces held in a thread's arena."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from asynccache.download import heap

# In a fresh process, a thread (as the I/O thread does) receives 64 pieces of 256 KiB and
# frees every other one: the freed ones stay resident in its arena until trimmed.
_CHILD = """
import importlib.util, os, sys, threading

spec = importlib.util.spec_from_file_location("heap", sys.argv[1])  # (not the whole package)
heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)

def anon():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) << 10

out = {}

def work():
    x = os.urandom(256 << 10)
    del x  # glibc now serves pieces of this size from the arena, not their own mappings
    pieces = [os.urandom(256 << 10) for _ in range(64)]
    kept = pieces[1::2]
    del pieces
    out["before"] = anon()
    heap.trim()
    out["after"] = anon()
    del kept

t = threading.Thread(target=work)
t.start()
t.join()
print(out["before"] - out["after"])
"""


@pytest.mark.skipif(
    not Path("/proc/self/smaps_rollup").exists() or platform.libc_ver()[0] != "glibc",
    reason="glibc on Linux",
)
def test_trim_returns_the_freed_pieces_pages() -> None:
    got = subprocess.run(
        [sys.executable, "-c", _CHILD, heap.__file__],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    freed = int(got.stdout.split()[-1])
    assert freed >= 4 << 20  # 32 freed pieces: 8 MiB of them resident before the trim
