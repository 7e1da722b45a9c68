"""az:// specifics: URL forms, each credential kind against Azurite, throttling headers."""

from __future__ import annotations

import datetime
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from asynccache.config import Settings
from asynccache.errors import AuthError, ConfigError, ObjectNotFoundError, TransientError
from asynccache.storage import open_storage
from asynccache.storage.errmap import status_error
from asynccache.testing.azurite import ACCOUNT, ACCOUNT_KEY, Azurite
from asynccache.testing.faults import ServerThread

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("url", "shown", "endpoint"),
    [
        ("az://data/ds/", "az://data/ds", "https://acct.blob.core.windows.net"),
        ("az://data@other/ds", "az://data@other/ds", "https://other.blob.core.windows.net"),
        (
            "abfss://data@other.dfs.core.windows.net/a/b",
            "abfss://data@other.dfs.core.windows.net/a/b",
            "https://other.blob.core.windows.net",
        ),
    ],
)
def test_url_forms(url: str, shown: str, endpoint: str) -> None:
    storage = open_storage(url, Settings(), {"account_name": "acct"} if "@" not in url else {})
    assert storage.url == shown
    assert storage.endpoint == endpoint  # type: ignore[attr-defined]
    assert storage.auth.source == "DefaultAzureCredential"  # type: ignore[attr-defined]


@pytest.mark.parametrize("url", ["az://", "az://UPPER/x", "az://c/a//b", "az://ab/x", "az://c@/x"])
def test_malformed_az_urls(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_storage(url, Settings(), {"account_name": "acct"})
    assert url in str(err.value)


def test_account_is_required_and_credentials_exclusive() -> None:
    with pytest.raises(ConfigError, match="no Azure storage account"):
        open_storage("az://data/ds", Settings(), aws_env={})
    with pytest.raises(ConfigError, match="at most one"):
        open_storage(
            "az://data", Settings(), {"account_name": "a", "account_key": "k", "anon": True}
        )
    with pytest.raises(ConfigError, match="credential"):
        open_storage("az://data", Settings(), {"account_name": "a", "credential": object()})


def test_without_the_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "azure.storage.blob", None)
    with pytest.raises(ConfigError, match=r"pip install 'asynccache\[azure\]'") as err:
        open_storage("az://data/ds", Settings())
    assert "az://data/ds" in str(err.value)


def test_env_mapping_is_read_in_config() -> None:
    env = Settings.aws_env(
        {"AZURE_STORAGE_ACCOUNT": "envacct", "AZURE_STORAGE_KEY": "a2V5", "AZURE_CLIENT_ID": "x"}
    )
    assert env == {"AZURE_STORAGE_ACCOUNT": "envacct", "AZURE_STORAGE_KEY": "a2V5"}
    storage = open_storage("az://data", Settings(), aws_env=env)
    assert storage.endpoint == "https://envacct.blob.core.windows.net"  # type: ignore[attr-defined]
    assert storage.auth.source == "AZURE_STORAGE_KEY"  # type: ignore[attr-defined]


async def _round_trip(url: str, options: dict[str, Any], tmp_path: Path, **kw: Any) -> None:
    (tmp_path / "f").write_bytes(b"0123456789")
    storage = open_storage(url, Settings(), options, **kw)
    try:
        assert await storage.upload(tmp_path / "f", "k/a b+c.bin") == 10
        assert await storage.read("k/a b+c.bin", 2, 5) == b"234"
        assert [o.key for o in await storage.list("k/")] == ["k/a b+c.bin"]
        await storage.delete("k/a b+c.bin")
        with pytest.raises(ObjectNotFoundError):
            await storage.head("k/a b+c.bin")
    finally:
        await storage.close()


async def test_connection_string_from_env_mapping(
    azurite: Azurite, az_container: str, tmp_path: Path
) -> None:
    await _round_trip(f"az://{az_container}/p", {}, tmp_path, aws_env=azurite.env)


async def test_abfs_url_reads_through_the_blob_endpoint(
    azurite: Azurite, az_container: str, tmp_path: Path
) -> None:
    url = f"abfs://{az_container}@{ACCOUNT}.dfs.core.windows.net/p"
    opts = {"account_key": ACCOUNT_KEY, "endpoint_url": azurite.endpoint_url}
    await _round_trip(url, opts, tmp_path)


async def test_sas_token(azurite: Azurite, az_container: str, tmp_path: Path) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    sas = generate_container_sas(
        ACCOUNT,
        az_container,
        account_key=ACCOUNT_KEY,
        permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True),
        expiry=expiry,
    )
    opts = {"account_name": ACCOUNT, "sas_token": sas, "endpoint_url": azurite.endpoint_url}
    await _round_trip(f"az://{az_container}", opts, tmp_path)
    signature = next(p for p in sas.split("&") if p.startswith("sig="))
    tampered = sas.replace(signature, "sig=AAAA" + signature[8:])
    bad = open_storage(f"az://{az_container}", Settings(), dict(opts, sas_token=tampered))
    try:
        with pytest.raises(AuthError) as err:
            await bad.list()
    finally:
        await bad.close()
    assert "storage_options sas_token" in str(err.value)
    assert signature[4:] not in str(err.value) and "sig=" not in str(err.value)


async def test_wrong_account_key_is_auth_error_without_leaking(
    azurite: Azurite, az_container: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXk="
    opts = dict(azurite.storage_options, account_key=wrong)
    storage = open_storage(f"az://{az_container}/ds", Settings(timeout_s=5), opts)
    try:
        with pytest.raises(AuthError) as err:
            await storage.head("index.json")
        with pytest.raises(AuthError):
            await storage.read("index.json")
    finally:
        await storage.close()
    assert f"az://{az_container}/ds/index.json" in str(err.value)
    assert "storage_options account_key" in str(err.value)
    for text in (str(err.value), repr(err.value), repr(storage), caplog.text):
        assert wrong not in text and ACCOUNT_KEY not in text


async def test_missing_container_is_not_found(azurite: Azurite) -> None:
    storage = open_storage("az://no-such-container/ds", Settings(), azurite.storage_options)
    try:
        with pytest.raises(ObjectNotFoundError, match="no-such-container"):
            await storage.read("index.json")
        with pytest.raises(ObjectNotFoundError, match="ContainerNotFound"):
            await storage.delete("index.json")
    finally:
        await storage.close()


class _StaticToken:
    """A user-supplied token credential (anything with azure-core's ``get_token``)."""

    def __init__(self) -> None:
        self.calls = 0

    def get_token(self, *scopes: str, **kw: Any) -> Any:
        from azure.core.credentials import AccessToken

        assert scopes == ("https://storage.azure.com/.default",)
        self.calls += 1
        return AccessToken("eyJ-bearer-token", int(time.time()) + 3600)


async def test_token_credential_sends_bearer_once_minted() -> None:
    seen: list[str | None] = []

    async def make_app() -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            seen.append(request.headers.get("Authorization"))
            return web.Response(
                headers={"Content-Length": "0"} if request.method == "HEAD" else None
            )

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    server = ServerThread(make_app, name="test-az-token")
    server.start()
    cred = _StaticToken()
    storage = open_storage(
        "az://data/ds",
        Settings(),
        {"account_name": "a", "credential": cred, "endpoint_url": server.url + "/a"},
    )
    try:
        await storage.head("x")
        await storage.head("y")
    finally:
        await storage.close()
        server.close()
    assert seen == ["Bearer eyJ-bearer-token"] * 2
    assert cred.calls == 1
    assert "eyJ" not in repr(storage)


@pytest.mark.parametrize(
    ("status", "headers", "delay"),
    [
        (503, {"x-ms-error-code": "ServerBusy", "x-ms-retry-after-ms": "1500"}, 1.5),
        (500, {"x-ms-error-code": "OperationTimedOut", "Retry-After": "3"}, 3.0),
        (429, {"retry-after-ms": "250"}, 0.25),
    ],
)
def test_azure_throttling_headers(status: int, headers: dict[str, str], delay: float) -> None:
    err = status_error(status, "az://c/k", headers=headers)
    assert isinstance(err, TransientError) and err.retry_after == delay


def test_head_error_code_from_header() -> None:
    err = status_error(
        403, "az://c/k", headers={"x-ms-error-code": "AuthenticationFailed"}, method="HEAD"
    )
    assert isinstance(err, AuthError) and "AuthenticationFailed" in str(err)


async def test_block_upload_in_parallel_parts_commits_once(
    azurite: Azurite, az_container: str, tmp_path: Path
) -> None:
    import os

    from asynccache.storage import AzureStorage

    data = os.urandom((1 << 20) + 300_000)
    (tmp_path / "big.bin").write_bytes(data)
    storage = open_storage(f"az://{az_container}/ds", Settings(), azurite.storage_options)
    assert isinstance(storage, AzureStorage)
    storage.multipart_threshold = 1 << 20
    storage.part_size = 256 << 10
    try:
        assert await storage.upload(tmp_path / "big.bin", "big.bin") == len(data)
        assert (await storage.head("big.bin")).size == len(data)
        assert await storage.read("big.bin", 262_000, 263_000) == data[262_000:263_000]
        listing = await storage.request(
            "GET", "big.bin", what="blocklist", query={"comp": "blocklist"}
        )
    finally:
        await storage.close()
    assert listing.body.count(b"<Block>") == 6  # five full blocks and a short last one
    assert b"<UncommittedBlocks/>" in listing.body or b"<UncommittedBlocks>" not in listing.body


async def test_default_azure_credential_through_managed_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DefaultAzureCredential (azure-identity reads its own variables) on a loopback
    App Service managed-identity endpoint; the bearer token reaches the blob endpoint."""
    minted: list[dict[str, str]] = []
    seen: list[str | None] = []

    async def make_app() -> web.Application:
        async def token(request: web.Request) -> web.Response:
            minted.append({**request.query, "header": request.headers.get("X-IDENTITY-HEADER", "")})
            expires = str(int(time.time()) + 3600)
            return web.json_response(
                {
                    "access_token": "mi-token",
                    "expires_on": expires,
                    "resource": "https://storage.azure.com",
                    "token_type": "Bearer",
                }
            )

        async def blob(request: web.Request) -> web.Response:
            seen.append(request.headers.get("Authorization"))
            return web.Response(headers={"Content-Length": "0"})

        app = web.Application()
        app.router.add_get("/msi/token", token)
        app.router.add_route("HEAD", "/{tail:.*}", blob)
        return app

    server = ServerThread(make_app, name="test-az-identity")
    server.start()
    for name in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_USERNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDENTITY_ENDPOINT", server.url + "/msi/token")
    monkeypatch.setenv("IDENTITY_HEADER", "identity-header")
    storage = open_storage(
        "az://data@acct/ds", Settings(), {"endpoint_url": server.url + "/acct"}, aws_env={}
    )
    try:
        assert storage.auth.source == "DefaultAzureCredential"  # type: ignore[attr-defined]
        await storage.head("a")
        await storage.head("b")
    finally:
        await storage.close()
        server.close()
    assert seen == ["Bearer mi-token"] * 2
    assert len(minted) == 1 and minted[0]["resource"] == "https://storage.azure.com"
    assert minted[0]["header"] == "identity-header"
