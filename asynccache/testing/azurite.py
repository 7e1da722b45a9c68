"""A real Azure Blob emulator on loopback: Azurite, installed from npm by ``make install``.

:class:`Azurite` runs ``azurite-blob`` (from the project's ``node_modules``, else from
``PATH``) on a free 127.0.0.1 port, in memory, with telemetry off, and stops it by PID.
It serves the emulator's well-known development account (``devstoreaccount1``, whose
public key is documented by Microsoft); SharedKey and SAS signatures are checked for
real, so a wrong key is rejected.

Run ``python -m asynccache.testing.azurite`` to keep one in the foreground.
"""

from __future__ import annotations

import contextlib
import email.utils
import shutil
import time
from pathlib import Path

from ..errors import ConfigError
from .procserver import ProcessServer, http_status

__all__ = ["ACCOUNT", "ACCOUNT_KEY", "Azurite", "find_azurite"]

#: Azurite's built-in development account and its published key.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_PROJECT = Path(__file__).resolve().parents[2]


def find_azurite() -> str:
    """Path of ``azurite-blob``: the project's ``node_modules/.bin``, else ``PATH``."""
    local = _PROJECT / "node_modules" / ".bin" / "azurite-blob"
    if local.is_file():
        return str(local)
    found = shutil.which("azurite-blob")
    if found is None:
        raise ConfigError(
            "azurite-blob was not found; run `make install` (npm installs azurite into "
            "node_modules) or npm install azurite"
        )
    return found


class Azurite(ProcessServer):
    """Azurite's blob service on ``http://127.0.0.1:<port>/devstoreaccount1``."""

    name = "azurite"

    def command(self, root: Path, port: int) -> list[str]:
        return [
            find_azurite(),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--disableTelemetry",
            "--disableProductStyleUrl",
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ]

    def ready(self) -> bool:
        # Any HTTP answer (an auth error included) means the blob service is listening.
        status, _ = http_status("GET", f"{self.endpoint_url}?comp=list", timeout_s=2.0)
        return status > 0

    @property
    def endpoint_url(self) -> str:
        """The account's blob endpoint (path-style: host, port, account)."""
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.endpoint_url};"
        )

    @property
    def storage_options(self) -> dict[str, str]:
        """Options for :func:`asynccache.storage.open_storage` (SharedKey on this server)."""
        return {
            "account_name": ACCOUNT,
            "account_key": ACCOUNT_KEY,
            "endpoint_url": self.endpoint_url,
        }

    @property
    def env(self) -> dict[str, str]:
        """``AZURE_STORAGE_CONNECTION_STRING`` for this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def _signed(self, method: str, path: str, query: str) -> tuple[int, bytes]:
        from azure.core.pipeline import PipelineContext, PipelineRequest
        from azure.core.pipeline.transport import HttpRequest
        from azure.storage.blob._shared.authentication import SharedKeyCredentialPolicy

        url = f"{self.endpoint_url}/{path}?{query}"
        headers = {"x-ms-version": "2021-12-02", "x-ms-date": email.utils.formatdate(usegmt=True)}
        request = HttpRequest(method, url, headers=headers)
        SharedKeyCredentialPolicy(ACCOUNT, ACCOUNT_KEY).on_request(
            PipelineRequest(request, PipelineContext(None))
        )
        return http_status(method, url, headers=dict(request.headers))

    def create_container(self, name: str) -> None:
        """Create container ``name``; an existing one is fine."""
        status, body = self._signed("PUT", name, "restype=container")
        if status not in (201, 409):
            raise RuntimeError(f"creating container {name} -> {status}: {body[:200]!r}")

    def delete_container(self, name: str) -> None:
        """Delete container ``name`` and its blobs."""
        self._signed("DELETE", name, "restype=container")


def main() -> None:
    """Run one emulator in the foreground until interrupted, printing how to reach it."""
    with Azurite() as server:
        assert isinstance(server, Azurite)
        server.create_container("asynccache")
        for key, value in server.env.items():
            print(f"export {key}='{value}'")
        print(f"# container 'asynccache' created; pid {server.pid}; Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
