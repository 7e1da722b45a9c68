"""No credential follows a redirect to another origin, on any backend or receive path.

The fault proxy sits in front of each real server (SeaweedFS, fake-gcs-server, Azurite,
the Hub imitation, a static HTTP server) and answers the object's GET with a 307 to a
second loopback server on another port, which records every header it gets and serves
the same bytes. It must see no credential: no ``Authorization``, no
``X-Amz-Security-Token`` or other signature header, none of the user's ``headers``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict

from asynccache.config import Settings
from asynccache.errors import StorageError
from asynccache.storage import open_storage
from asynccache.storage.base import Storage
from asynccache.testing.faults import Fault, FaultProxy, ServerThread

pytestmark = pytest.mark.timeout(60)

DATA = bytes(range(256)) * 400  # 100 KiB
NAME = "obj.bin"
SESSION_TOKEN = "session-" + "t" * 40
BEARER = "Bearer tok-" + "s" * 24
API_KEY = "key-" + "k" * 24
# Names of credential headers and the secrets themselves: neither may reach the recorder.
CREDENTIAL_HEADERS = ("authorization", "x-amz-security-token", "x-api-key", "cookie")
SECRETS = (SESSION_TOKEN, BEARER, API_KEY, "tok-")


class Recorder:
    """A second origin: records each request's headers, serves ``DATA`` (ranged)."""

    def __init__(self) -> None:
        self.seen: list[CIMultiDict[str]] = []
        self.server = ServerThread(self._app, name="test-redirect-recorder")

    @property
    def url(self) -> str:
        return self.server.url

    async def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.Response:
        self.seen.append(CIMultiDict(request.headers))
        rng = request.headers.get("Range") or request.headers.get("x-ms-range")
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": str(len(DATA))})
        if rng:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            end = min(len(DATA), int(b) + 1) if b else len(DATA)
            return web.Response(
                status=206,
                body=DATA[int(a) : end],
                headers={"Content-Range": f"bytes {a}-{end - 1}/{len(DATA)}"},
            )
        return web.Response(body=DATA)

    def assert_no_credential(self) -> None:
        for headers in self.seen:
            names = {k.lower() for k in headers}
            assert not names & set(CREDENTIAL_HEADERS), names
            assert not any(k.lower().startswith("x-amz-") for k in names), names
            text = repr(list(headers.items()))
            assert not any(s in text for s in SECRETS), text


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    rec.server.start()
    yield rec
    rec.server.close()


class _Sink:
    def __init__(self) -> None:
        self.got = bytearray()

    def write(self, data: bytes | memoryview, /) -> bool:
        self.got += data
        return True

    def closing(self) -> None:
        pass


async def _read_both_ways(storage: Storage) -> tuple[bytes, bytes]:
    """A range through ``read`` (aiohttp) and one through ``receive_into`` (the backend's
    own receiver where it has one)."""
    try:
        first = await storage.read(NAME, 10, 5000)
        sink = _Sink()
        await storage.receive_into(NAME, 100, 60_000, sink)
        return first, bytes(sink.got)
    finally:
        await storage.close()


def _redirect(proxy: FaultProxy, location: str, times: int = 100) -> None:
    """Every GET and HEAD of the object (our own receiver's included, which leaves a
    redirect to the backend's aiohttp path, which asks again) is redirected."""
    proxy.add_fault(
        Fault("redirect", times=times, path=NAME, location=location, methods=("GET", "HEAD"))
    )


# -- http(s): the user's headers ------------------------------------------------------------


@pytest.mark.parametrize("receive", ["direct", "aiohttp"])
async def test_http_headers_stay_home(recorder, http_origin, tmp_path: Path, receive) -> None:
    (tmp_path / NAME).write_bytes(DATA)
    origin = http_origin(tmp_path)
    with FaultProxy(origin.url) as proxy:
        _redirect(proxy, recorder.url)
        options = {"headers": {"Authorization": BEARER, "X-Api-Key": API_KEY}}
        storage = open_storage(proxy.url, Settings(receive=receive, timeout_s=5.0), options)
        first, second = await _read_both_ways(storage)
        assert proxy.fired("redirect") >= 2
    assert (first, second) == (DATA[10:5000], DATA[100:60_000])
    assert len(recorder.seen) == 2  # both reads followed the redirect ...
    recorder.assert_no_credential()  # ... without the user's headers
    assert all(r.range for r in proxy.requests)  # (the proxy saw them, with the headers)


# -- s3: a session token --------------------------------------------------------------------


def _s3(objstore, bucket: str, endpoint: str, receive: str, **extra: Any) -> Storage:
    options = dict(objstore.storage_options, endpoint_url=endpoint, **extra)
    return open_storage(f"s3://{bucket}/ds", Settings(receive=receive, timeout_s=5.0), options)


async def _put(objstore, bucket: str) -> None:
    storage = _s3(objstore, bucket, objstore.endpoint_url, "aiohttp")
    try:
        with tempfile.NamedTemporaryFile(prefix="asynccache-test-") as f:
            f.write(DATA)
            f.flush()
            await storage.upload(f.name, NAME)
    finally:
        await storage.close()


@pytest.mark.parametrize("receive", ["direct", "aiohttp"])
async def test_s3_refuses_a_redirect_elsewhere_naming_both_hosts(
    objstore, bucket, recorder, receive
) -> None:
    await _put(objstore, bucket)
    with FaultProxy(objstore.endpoint_url) as proxy:
        _redirect(proxy, recorder.url, times=10)
        storage = _s3(objstore, bucket, proxy.url, receive, aws_session_token=SESSION_TOKEN)
        try:
            for attempt in (
                storage.read(NAME, 10, 5000),
                storage.receive_into(NAME, 0, 10, _Sink()),
            ):
                with pytest.raises(StorageError) as info:
                    await attempt
                message = str(info.value)
                port = proxy.url.rsplit(":", 1)[1]
                assert f"127.0.0.1:{port}" in message  # the bucket's host ...
                assert recorder.url.removeprefix("http://") in message  # ... and the other
                assert SESSION_TOKEN not in message
            with pytest.raises(StorageError, match="redirected"):
                await storage.head(NAME)  # signed requests of every kind
        finally:
            await storage.close()
        assert proxy.fired("redirect") >= 2
    assert recorder.seen == []  # never contacted: nothing to leak


async def test_s3_same_origin_redirect_is_signed_again(objstore, bucket) -> None:
    await _put(objstore, bucket)
    with FaultProxy(objstore.endpoint_url) as proxy:
        _redirect(proxy, proxy.url, times=2)  # 307 to the same URL, same origin
        storage = _s3(objstore, bucket, proxy.url, "aiohttp")
        first, second = await _read_both_ways(storage)
        assert proxy.fired("redirect") == 2
        hops = [r for r in proxy.requests if r.method == "GET" and NAME in r.path]
        assert len(hops) == 4  # each GET, then its redirected hop
    assert (first, second) == (DATA[10:5000], DATA[100:60_000])


@pytest.mark.parametrize("receive", ["direct", "aiohttp"])
async def test_s3_anonymous_follows_a_redirect_elsewhere(objstore, recorder, receive) -> None:
    with FaultProxy(objstore.endpoint_url) as proxy:
        _redirect(proxy, recorder.url)
        storage = open_storage(
            "s3://public/ds",
            Settings(receive=receive, timeout_s=5.0),
            {"endpoint_url": proxy.url, "anon": True},
        )
        first, second = await _read_both_ways(storage)
        assert proxy.fired("redirect") >= 2
    assert (first, second) == (DATA[10:5000], DATA[100:60_000])
    assert len(recorder.seen) == 2
    recorder.assert_no_credential()


# -- gcs, azure: bearer token, SharedKey ---------------------------------------------------


async def test_gcs_token_stays_home(gcs_emulator, gcs_bucket, recorder, tmp_path: Path) -> None:
    (tmp_path / NAME).write_bytes(DATA)
    up = open_storage(f"gs://{gcs_bucket}/ds", Settings(), gcs_emulator.storage_options)
    try:
        await up.upload(tmp_path / NAME, NAME)
    finally:
        await up.close()
    endpoint = gcs_emulator.storage_options["endpoint_url"]
    with FaultProxy(endpoint) as proxy:
        _redirect(proxy, recorder.url)
        options = {"endpoint_url": proxy.url, "token": BEARER.removeprefix("Bearer ")}
        storage = open_storage(f"gs://{gcs_bucket}/ds", Settings(timeout_s=5.0), options)
        first, second = await _read_both_ways(storage)
        assert proxy.fired("redirect") >= 2
    assert (first, second) == (DATA[10:5000], DATA[100:60_000])
    assert len(recorder.seen) == 2
    recorder.assert_no_credential()


async def test_azure_shared_key_stays_home(azurite, az_container, recorder, tmp_path) -> None:
    (tmp_path / NAME).write_bytes(DATA)
    options = dict(azurite.storage_options)
    up = open_storage(f"az://{az_container}/ds", Settings(), options)
    try:
        await up.upload(tmp_path / NAME, NAME)
    finally:
        await up.close()
    endpoint = f"http://127.0.0.1:{azurite.port}"
    with FaultProxy(endpoint) as proxy:
        _redirect(proxy, recorder.url)
        options["endpoint_url"] = proxy.url + "/" + options["account_name"]
        storage = open_storage(f"az://{az_container}/ds", Settings(timeout_s=5.0), options)
        first, second = await _read_both_ways(storage)
        assert proxy.fired("redirect") >= 2
    assert (first, second) == (DATA[10:5000], DATA[100:60_000])
    assert len(recorder.seen) == 2
    recorder.assert_no_credential()


# -- hf: the Hub token ---------------------------------------------------------------------


async def test_hub_token_stays_home(hub, recorder) -> None:
    hub.token = "hf_" + "k" * 30
    hub.commit("org/ds", {NAME: DATA}, private=True)
    with FaultProxy(hub.url) as proxy:
        proxy.add_fault(Fault("redirect", times=1, path="resolve", location=recorder.url))
        storage = open_storage(
            "hf://datasets/org/ds",
            Settings(timeout_s=5.0),
            {"endpoint_url": proxy.url, "token": hub.token},
        )
        first, second = await _read_both_ways(storage)
        assert proxy.fired("redirect") == 1
    assert (first, second) == (DATA[10:5000], DATA[100:60_000])
    assert recorder.seen
    recorder.assert_no_credential()
    assert not any(hub.token in repr(list(h.items())) for h in recorder.seen)


# -- cookies: never kept from answers ------------------------------------------------------


@pytest.fixture
def cookie_origin(recorder) -> Iterator[str]:
    """An origin that sets a session cookie on every answer and redirects ``/moved/*``
    to the recorder: another port of the same host, reached by the same name."""
    port = recorder.url.rsplit(":", 1)[1]

    async def make_app() -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            if request.path.startswith("/moved/"):
                resp: web.StreamResponse = web.Response(
                    status=307, headers={"Location": f"http://localhost:{port}{request.path}"}
                )
            else:
                resp = web.Response(body=DATA)
            resp.set_cookie("sid", "cookie-" + "c" * 24)
            return resp

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    server = ServerThread(make_app, name="test-cookie-origin")
    server.start()
    yield "http://localhost:" + server.url.rsplit(":", 1)[1]
    server.close()


async def test_cookies_an_origin_sets_go_nowhere(cookie_origin, recorder) -> None:
    storage = open_storage(cookie_origin, Settings(timeout_s=5.0))
    try:
        assert await storage.read(NAME, 0, 100) == DATA[:100]  # an answer with a cookie
        assert await storage.read(f"moved/{NAME}", 10, 20) == DATA[10:20]
    finally:
        await storage.close()
    assert len(recorder.seen) == 1
    recorder.assert_no_credential()
    assert "cookie-" not in repr(list(recorder.seen[0].items()))
