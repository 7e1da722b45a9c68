"""The memory probes of benchmarks/limits.py measure a real child process correctly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import limits

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps_rollup").exists(), reason="needs /proc/<pid>/smaps_rollup"
)

# A child that holds an unaligned 6 MiB copy of the file's payload and 64 MiB of other
# anonymous memory, says so, and waits to be told to leave (bounded).
_CHILD = """
import sys, numpy as np
data = open(sys.argv[1], "rb").read()
copy = bytearray(data[12345 : 12345 + (6 << 20)])
other = np.ones(64 << 20, dtype=np.uint8)
del data
print("ready", flush=True)
sys.stdin.readline()
"""


def test_finder_and_sampler_see_a_child_holding_chunk_bytes(tmp_path: Path) -> None:
    chunk = tmp_path / "chunk.bin"
    chunk.write_bytes(np.random.default_rng(0).bytes(16 << 20))
    finder = limits.ChunkBytesFinder([chunk])
    assert finder.count(np.random.default_rng(1).bytes(1 << 20)) == 0
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(chunk)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        sampler = limits.PssSampler(child.pid, regions_min=1 << 20, regions_every=1, finder=finder)
        sampler.sample()
        found = {r.start: hits for r, hits in sampler.found if r.pid == child.pid}
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(30)
    # The 6 MiB copy (1,536 pages) is found at its odd alignment, and only chunk bytes count.
    assert 1500 <= max(found.values(), default=0) <= 6 << 8
    assert child.pid in sampler.at_peak_by_pid
    assert sampler.at_peak_by_pid[child.pid]["Pss_Anon"] >= 64 << 20
    assert sampler.peak["Pss"] >= sampler.at_peak_by_pid[child.pid]["Pss"]


def test_the_samplers_own_cpu_is_left_out_of_the_clients() -> None:
    """Reading smaps_rollup costs the sampling thread CPU (10-40% of a cold epoch's client
    CPU on a loaded box): the clock subtracts exactly what the samplers report."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        clock = limits.CpuClock().start()
        with (
            limits.PssSampler(child.pid, interval_s=0.0) as pss,
            limits.PeakSampler(interval_s=0.05) as peaks,
        ):
            while pss.samples < 20 or peaks.peak_mem == 0:
                pss._stop.wait(0.01)
        clock.stop(pss, peaks)
    finally:
        child.communicate(timeout=30)
    assert pss.cpu_s > 0 and peaks.cpu_s > 0
    assert clock.instruments == pss.cpu_s + peaks.cpu_s
    assert clock.client == pytest.approx(clock.total - clock.instruments)
