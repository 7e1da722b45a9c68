"""Error mapping at the storage boundary, against real servers on loopback."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from asynccache.config import Settings
from asynccache.errors import (
    AuthError,
    ConfigError,
    ObjectNotFoundError,
    StorageError,
    StorageTimeoutError,
    TransientError,
)
from asynccache.storage import open_storage
from asynccache.testing import ObjectStore, StaticHTTPServer

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
RawServer = Callable[[Handler], Awaitable[str]]
HttpOrigin = Callable[..., StaticHTTPServer]


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/x",
        "s3://",
        "s3:///key",
        "s3://bad bucket/x",
        "http://",
        "file://remote/x",
        "gopher://h",
        "s3://b/a//c",
    ],
)
def test_malformed_or_unknown_urls_raise_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_storage(url, Settings())
    assert url in str(err.value)
    assert isinstance(err.value, ValueError)


def test_unknown_storage_option_is_config_error() -> None:
    with pytest.raises(ConfigError, match="endpoint"):
        open_storage("s3://bkt/x", Settings(), {"endpiont_url": "http://127.0.0.1:1"})


def test_credentials_in_http_url_are_refused_and_redacted() -> None:
    with pytest.raises(ConfigError) as err:
        open_storage("https://user:hunter2@example.com/ds", Settings())
    assert "hunter2" not in str(err.value)


def test_s3_endpoint_and_region_from_aws_env_mapping() -> None:
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "eu-west-3"}
    storage = open_storage("s3://bkt/prefix/", Settings(), aws_env=env)
    assert storage.url == "s3://bkt/prefix"
    assert storage.endpoint == "http://127.0.0.1:9"  # type: ignore[attr-defined]
    assert storage.signer.region == "eu-west-3"  # type: ignore[attr-defined]
    assert storage.href("k") == "http://127.0.0.1:9/bkt/prefix/k"  # type: ignore[attr-defined]
    aws = open_storage("s3://bkt", Settings(), aws_env={})
    assert aws.href("k") == "https://bkt.s3.us-east-1.amazonaws.com/k"  # type: ignore[attr-defined]


# -- S3 auth --------------------------------------------------------------------------
async def test_wrong_secret_is_auth_error_without_leaking(
    objstore: ObjectStore, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "wrong-secret-" + "x" * 20
    opts = objstore.storage_options | {"aws_secret_access_key": secret}
    storage = open_storage(f"s3://{bucket}/ds", Settings(timeout_s=5), opts)
    started = time.monotonic()
    try:
        with pytest.raises(AuthError) as err:
            await storage.head("index.json")
        with pytest.raises(AuthError):
            await storage.list()
    finally:
        await storage.close()
    assert time.monotonic() - started < 5
    assert isinstance(err.value, PermissionError)
    assert "storage_options" in str(err.value)  # names the credential source
    assert f"s3://{bucket}/ds/index.json" in str(err.value)
    for text in (
        str(err.value),
        repr(err.value),
        repr(storage),
        repr(storage.signer),  # type: ignore[attr-defined]
        caplog.text,
    ):
        assert secret not in text
        assert objstore.secret_key not in text


async def test_wrong_access_key_via_env_chain(
    objstore: ObjectStore, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Credentials from botocore's chain (environment): the message names that source.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKNOTAKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    storage = open_storage(
        f"s3://{bucket}", Settings(), aws_env={"AWS_ENDPOINT_URL": objstore.endpoint_url}
    )
    try:
        with pytest.raises(AuthError, match="env") as err:
            await storage.read("k")
    finally:
        await storage.close()
    assert "not-the-secret-at-all" not in str(err.value)


async def test_missing_bucket_and_key(objstore: ObjectStore, bucket: str) -> None:
    missing = open_storage("s3://no-such-bucket-4242/ds", Settings(), objstore.storage_options)
    present = open_storage(f"s3://{bucket}", Settings(), objstore.storage_options)
    try:
        with pytest.raises(ObjectNotFoundError, match="no-such-bucket-4242"):
            await missing.read("index.json")
        with pytest.raises(ObjectNotFoundError):
            await missing.list()
        with pytest.raises(ObjectNotFoundError, match=r"missing\.bin"):
            await present.read("missing.bin")
        with pytest.raises(ObjectNotFoundError):
            await present.head("missing.bin")
    finally:
        await missing.close()
        await present.close()


# -- misbehaving servers ----------------------------------------------------------------
@pytest.fixture
async def raw_server() -> AsyncIterator[RawServer]:
    """Start raw TCP servers on loopback that speak whatever HTTP the test writes."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5)


async def _reply(
    writer: asyncio.StreamWriter, reader: asyncio.StreamReader, raw: bytes, *, close: bool = True
) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(raw)
    await writer.drain()
    if close:
        writer.close()


async def test_short_body_raises_transient_after_yielding(raw_server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _reply(
            writer, reader, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 400
        )

    url = await raw_server(handler)
    storage = open_storage(url, Settings(timeout_s=5))
    got = bytearray()
    try:
        with pytest.raises(TransientError) as err:
            async for piece in storage.iter_range("obj"):
                got += piece
    finally:
        await storage.close()
    assert bytes(got) == b"x" * 400
    assert f"{url}/obj" in str(err.value)
    assert err.value.__cause__ is not None or "400 of 1000" in str(err.value)


@pytest.mark.parametrize(
    ("status", "header", "expected"),
    [(503, "Retry-After: 7\r\n", 7.0), (429, "Retry-After: 2\r\n", 2.0), (500, "", None)],
)
async def test_busy_statuses_are_transient_with_retry_after(
    raw_server: RawServer, status: int, header: str, expected: float | None
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _reply(
            writer, reader, f"HTTP/1.1 {status} Busy\r\n{header}Content-Length: 0\r\n\r\n".encode()
        )

    url = await raw_server(handler)
    storage = open_storage(url, Settings(timeout_s=5))
    try:
        with pytest.raises(TransientError) as err:
            await storage.read("obj")
    finally:
        await storage.close()
    assert err.value.retry_after == expected
    assert not isinstance(err.value, StorageTimeoutError)


async def test_connection_reset_is_transient(raw_server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.transport.abort()

    url = await raw_server(handler)
    storage = open_storage(url, Settings(timeout_s=5))
    try:
        with pytest.raises(TransientError) as err:
            await storage.head("obj")
    finally:
        await storage.close()
    assert err.value.__cause__ is not None


async def test_stalled_server_is_timeout(raw_server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(30)

    url = await raw_server(handler)
    storage = open_storage(url, Settings(timeout_s=0.5))
    started = time.monotonic()
    try:
        with pytest.raises(StorageTimeoutError) as err:
            await storage.read("obj")
    finally:
        await storage.close()
    assert time.monotonic() - started < 5
    assert isinstance(err.value, TimeoutError)
    assert f"{url}/obj" in str(err.value)


async def test_connection_refused_is_transient() -> None:
    from asynccache.testing import free_port

    url = f"http://127.0.0.1:{free_port()}"
    storage = open_storage(url, Settings(timeout_s=2))
    try:
        with pytest.raises(TransientError, match=r"127\.0\.0\.1"):
            await storage.head("obj")
    finally:
        await storage.close()


# -- TLS ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


async def test_tls_verified_by_default(
    self_signed: tuple[Path, Path], tmp_path: Path, http_origin: HttpOrigin
) -> None:
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*self_signed)
    (tmp_path / "obj").write_bytes(b"secret data")
    server = http_origin(tmp_path, tls=ctx)
    assert server.url.startswith("https://")

    default = open_storage(server.url, Settings(timeout_s=5))
    assert default.verify  # type: ignore[attr-defined]
    try:
        with pytest.raises(StorageError, match="verify") as err:
            await default.read("obj")
    finally:
        await default.close()
    assert not isinstance(err.value, TransientError)  # retrying will not help
    assert server.url in str(err.value)

    for off in (
        open_storage(server.url, Settings(), {"verify": False}),
        open_storage(server.url, Settings(verify_tls=False)),
    ):
        try:
            assert await off.read("obj") == b"secret data"
        finally:
            await off.close()


def test_s3_verify_option_reaches_connector() -> None:
    on = open_storage("s3://bkt", Settings(), {"endpoint_url": "https://127.0.0.1:1"})
    off = open_storage(
        "s3://bkt", Settings(), {"endpoint_url": "https://127.0.0.1:1", "verify": False}
    )
    assert on.session_holder.ssl_mode is True  # type: ignore[attr-defined]
    assert off.session_holder.ssl_mode is False  # type: ignore[attr-defined]
    with pytest.raises(ConfigError):
        open_storage("s3://bkt", Settings(), {"verify": "maybe"})


async def test_server_ignoring_range_is_trimmed(raw_server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _reply(writer, reader, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789")

    url = await raw_server(handler)
    storage = open_storage(url, Settings(timeout_s=5))
    try:
        assert await storage.read("obj", 3, 6) == b"345"
        assert await storage.read("obj", 8) == b"89"
        assert await storage.read("obj", 20) == b""
    finally:
        await storage.close()
