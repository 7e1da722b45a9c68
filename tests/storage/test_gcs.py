"""gs:// specifics: URL forms, the endpoint override, credentials through google-auth."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from asynccache.config import Settings
from asynccache.errors import AuthError, ConfigError, TransientError
from asynccache.storage import open_storage
from asynccache.testing.faults import ServerThread
from asynccache.testing.gcs_emulator import GcsEmulator

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "url", ["gs://", "gs:///x", "gs://Bad_Bucket!/x", "gs://b/a//c", "gs://b/../x"]
)
def test_malformed_gs_urls(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_storage(url, Settings())
    assert url in str(err.value)


def test_without_the_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "google.auth", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'asynccache\[gcs\]'") as err:
        open_storage("gs://bkt/ds", Settings())
    assert "gs://bkt/ds" in str(err.value)


def test_endpoint_from_storage_emulator_host_read_by_config() -> None:
    env = Settings.aws_env({"STORAGE_EMULATOR_HOST": "127.0.0.1:9023", "HOME": "/x"})
    assert env == {"STORAGE_EMULATOR_HOST": "127.0.0.1:9023"}
    storage = open_storage("gs://bkt/a/b/", Settings(), aws_env=env)
    assert storage.url == "gs://bkt/a/b"
    assert storage.endpoint == "http://127.0.0.1:9023"  # type: ignore[attr-defined]
    assert storage.auth.anonymous  # type: ignore[attr-defined]
    google = open_storage("gs://bkt", Settings(), aws_env={})
    assert google.endpoint == "https://storage.googleapis.com"  # type: ignore[attr-defined]
    assert not google.auth.anonymous  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="at most one"):
        open_storage("gs://bkt", Settings(), {"token": "t", "anon": True})


async def test_emulator_via_env_mapping_round_trip(
    gcs_emulator: GcsEmulator, gcs_bucket: str, tmp_path: Path
) -> None:
    (tmp_path / "f").write_bytes(b"payload")
    storage = open_storage(f"gs://{gcs_bucket}/p", Settings(), aws_env=gcs_emulator.env)
    try:
        assert await storage.upload(tmp_path / "f", "k/e y+1.bin") == 7
        assert [o.key for o in await storage.list()] == ["k/e y+1.bin"]
        assert await storage.read("k/e y+1.bin", 1, 4) == b"ayl"
    finally:
        await storage.close()


class _Api:
    """A loopback stand-in for Google's token endpoint and the JSON API's metadata call."""

    def __init__(self) -> None:
        self.auth: list[str | None] = []
        self.token_posts = 0
        self.status = 200
        self.server = ServerThread(self._app, name="test-gcs-api")

    async def _app(self) -> web.Application:
        async def token(request: web.Request) -> web.Response:
            form = await request.post()
            assert form["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
            self.token_posts += 1
            return web.json_response({"access_token": "ya29.minted-token", "expires_in": 3600})

        async def meta(request: web.Request) -> web.Response:
            self.auth.append(request.headers.get("Authorization"))
            if self.status != 200:
                return web.Response(status=self.status, headers={"Retry-After": "4"})
            return web.json_response({"name": "x", "size": "3", "etag": "CAE="})

        app = web.Application()
        app.router.add_post("/token", token)
        app.router.add_get("/storage/v1/b/{bucket}/o/{name}", meta)
        return app


@pytest.fixture
def api() -> Iterator[_Api]:
    a = _Api()
    a.server.start()
    yield a
    a.server.close()


def _key_file(tmp_path: Path, token_uri: str) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    path = tmp_path / "sa.json"
    path.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": "p",
                "private_key_id": "k1",
                "private_key": pem,
                "client_email": "sa@p.iam.gserviceaccount.com",
                "client_id": "1",
                "token_uri": token_uri,
            }
        )
    )
    return path


async def test_service_account_key_file_mints_a_token_once(api: _Api, tmp_path: Path) -> None:
    key = _key_file(tmp_path, api.server.url + "/token")
    storage = open_storage(
        "gs://bkt/ds", Settings(), {"key_file": str(key), "endpoint_url": api.server.url}
    )
    try:
        assert (await storage.head("x")).size == 3
        assert (await storage.head("x")).size == 3
    finally:
        await storage.close()
    assert api.auth == ["Bearer ya29.minted-token"] * 2
    assert api.token_posts == 1  # cached until it expires
    assert "service_account" in repr(storage) and "minted" not in repr(storage)


async def test_google_application_credentials_through_the_default_chain(
    api: _Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = _key_file(tmp_path, api.server.url + "/token")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))  # read by google-auth
    emulator = open_storage("gs://bkt", Settings(), {"endpoint_url": api.server.url})
    assert emulator.auth.anonymous  # type: ignore[attr-defined]  # an endpoint: an emulator
    storage = open_storage("gs://bkt", Settings(), {"endpoint_url": api.server.url, "anon": False})
    try:
        assert (await storage.head("x")).size == 3  # anon=False: the default chain
    finally:
        await storage.close()
    assert api.auth == ["Bearer ya29.minted-token"]
    auth = storage.auth  # type: ignore[attr-defined]
    assert "google-auth default chain" in auth.source


async def test_rejected_token_and_throttling_are_mapped_without_the_token(
    api: _Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "ya29.secret-" + "q" * 20
    storage = open_storage(
        "gs://bkt/ds", Settings(), {"token": secret, "endpoint_url": api.server.url}
    )
    try:
        api.status = 401
        with pytest.raises(AuthError) as err:
            await storage.head("x")
        api.status = 429
        with pytest.raises(TransientError) as busy:
            await storage.head("x")
    finally:
        await storage.close()
    assert "gs://bkt/ds/x" in str(err.value) and "storage_options token" in str(err.value)
    assert busy.value.retry_after == 4.0
    for text in (str(err.value), repr(err.value), repr(storage), caplog.text):
        assert secret not in text


def test_emulator_lifecycle_stops_by_pid() -> None:
    import os

    with GcsEmulator() as server:
        assert isinstance(server, GcsEmulator)
        pid = server.pid
        assert Path(f"/proc/{pid}/stat").read_text().split()[0] == str(pid)
        server.create_bucket("life")
        server.create_bucket("life")  # already there: fine
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError):
        _ = server.pid
    server.stop()  # idempotent
