"""``python -m asynccache.testing.objstore`` as the README documents it: it starts a store,
prints the ``AWS_*`` variables that reach it, serves real signed requests, and on Ctrl-C
(or a plain ``kill``) stops the server it started and removes its directory."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]
# Bounds, not expectations: a cold SeaweedFS start on a loaded 2-core machine takes seconds.
_START_BOUND_S = 120.0
_STOP_BOUND_S = 30.0


def _lines(stream: object) -> queue.Queue[str | None]:
    """The lines of ``stream``, read by a daemon thread (``None`` at end of stream), so
    every wait for a line can be bounded."""
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for raw in stream:  # type: ignore[attr-defined]
            out.put(raw.decode(errors="replace").rstrip("\n"))
        out.put(None)

    threading.Thread(target=pump, name="objstore-cli-stdout", daemon=True).start()
    return out


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The module started as the README says, with a ``TMPDIR`` of its own; killed (by
    process group) if a test leaves it running."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynccache.testing.objstore"],
        cwd=_REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc, tmp
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=_STOP_BOUND_S)
        assert proc.stdout is not None
        proc.stdout.close()


def _read_banner(lines: queue.Queue[str | None]) -> tuple[dict[str, str], int, list[str]]:
    """The exported variables and the server's pid, from the module's first lines."""
    env: dict[str, str] = {}
    seen: list[str] = []
    deadline = time.monotonic() + _START_BOUND_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no banner within {_START_BOUND_S:.0f}s: {seen}")
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError(
                "the module exited before printing its banner:\n" + "\n".join(seen)
            )
        seen.append(line)
        exported = re.fullmatch(r"export (AWS_[A-Z_]+)=(.*)", line)
        if exported:
            env[exported[1]] = exported[2]
        pid = re.search(r"weed pid (\d+)", line)
        if pid:
            return env, int(pid[1]), seen


# What a user does after pasting the printed ``export`` lines: reach the store with the
# variables alone, as the library reads them (``Settings.aws_env``, botocore's chain).
_ROUND_TRIP = """
import asyncio, sys
from asynccache.config import Settings
from asynccache.storage import open_storage

async def main() -> None:
    storage = open_storage("s3://asynccache/cli-check", Settings(), aws_env=Settings.aws_env())
    try:
        await storage.upload(sys.argv[1], "hello.bin")
        sys.stdout.buffer.write(await storage.read("hello.bin"))
    finally:
        await storage.close()

asyncio.run(main())
"""


def _round_trip(env: dict[str, str], src: Path) -> bytes:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP, str(src)],
        cwd=_REPO,
        env={**clean, **env},
        capture_output=True,
        timeout=_STOP_BOUND_S * 2,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_module_serves_and_stops_clean(
    cli: tuple[subprocess.Popen[bytes], Path], tmp_path: Path, stop_signal: signal.Signals
) -> None:
    proc, tmp = cli
    assert proc.stdout is not None
    lines = _lines(proc.stdout)
    env, weed_pid, banner = _read_banner(lines)

    assert set(env) >= {
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
    }, banner
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", env["AWS_ENDPOINT_URL"])
    assert _pid_alive(weed_pid)
    assert any(p.name.startswith("asynccache-objstore-") for p in tmp.iterdir())

    # One real, signed request with exactly the printed variables.
    payload = os.urandom(4096)
    src = tmp_path / "hello.bin"
    src.write_bytes(payload)
    assert _round_trip(env, src) == payload

    proc.send_signal(stop_signal)
    assert proc.wait(timeout=_STOP_BOUND_S) == 0, list(lines.queue)
    # The server it started is gone (reaped, not a zombie) and its directory removed.
    assert not _pid_alive(weed_pid)
    assert list(tmp.iterdir()) == []
