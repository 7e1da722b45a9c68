"""A server process on a free loopback port, started and stopped by PID (emulators).

:class:`ProcessServer` launches a command that listens on ``127.0.0.1:<port>``, waits
(bounded) until a readiness probe succeeds, and stops it by PID (terminate, then kill) on
``stop()``, on ``__exit__``, at interpreter exit, and, on Linux, when the starting thread's
process dies (``PR_SET_PDEATHSIG``). A port taken between probing and binding is retried
on a fresh port a bounded number of times.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from .objstore import _die_with_parent, free_port

__all__ = ["ProcessServer", "http_status"]

_LAUNCH_ATTEMPTS = 3


def http_status(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
) -> tuple[int, bytes]:
    """One blocking HTTP request (for fixtures): ``(status, body)``; errors are statuses."""
    req = urllib.request.Request(url, method=method, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class ProcessServer:
    """Base class: subclasses give :meth:`command` and :meth:`ready`."""

    name = "server"

    def __init__(self, *, startup_timeout_s: float = 30.0) -> None:
        self.port = 0
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log: Path | None = None

    # -- what a subclass gives ------------------------------------------------------
    def command(self, root: Path, port: int) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """True once the server answers (called until it does, or the bound passes)."""
        raise NotImplementedError

    # -- lifecycle --------------------------------------------------------------------
    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    @property
    def root(self) -> Path:
        """The server's private temporary directory (data, log)."""
        if self._tmp is None:
            raise RuntimeError(f"{self.name} is not running")
        return Path(self._tmp.name)

    def __enter__(self) -> ProcessServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self._proc.pid}" if self._proc is not None else "stopped"
        return f"{type(self).__name__}(127.0.0.1:{self.port}, {state})"

    def start(self) -> None:
        if self._proc is not None:
            return
        for attempt in range(_LAUNCH_ATTEMPTS):
            self._launch()
            try:
                if self._wait_ready():
                    return
            except BaseException:
                self.stop()
                raise
            self.stop()  # exited early: most likely the port was taken meanwhile
            if attempt + 1 == _LAUNCH_ATTEMPTS:
                raise RuntimeError(f"{self.name} exited at start:\n{self._last_log}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the process by PID (SIGTERM, then SIGKILL after ``timeout_s``). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=timeout_s)
        atexit.unregister(self.stop)
        if self._tmp is not None:
            self._last_log = self.log_tail()
            self._tmp.cleanup()
            self._tmp = None

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    _last_log = ""

    def _launch(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"asynccache-{self.name}-")
        root = Path(self._tmp.name)
        self.port = free_port()
        self._log = root / "server.log"
        args = self.command(root, self.port)
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                args,
                cwd=root,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        atexit.register(self.stop)

    def _wait_ready(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                if self.ready():
                    return True
            time.sleep(0.1)
        raise RuntimeError(
            f"{self.name} on port {self.port} not ready after {self._startup_timeout_s:.0f}s:\n"
            f"{self.log_tail()}"
        )
