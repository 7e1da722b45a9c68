"""``storage_options={"headers": ...}`` for http(s): sent to the origin, never leaked."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from aiohttp import web

from asynccache.config import Settings
from asynccache.errors import AuthError, ConfigError
from asynccache.storage import open_storage
from asynccache.testing.faults import ServerThread

pytestmark = pytest.mark.timeout(30)

TOKEN = "Bearer tok-" + "s" * 24
DATA = bytes(range(256)) * 40


class _Seen:
    def __init__(self) -> None:
        self.origin: list[dict[str, str]] = []
        self.other: list[dict[str, str]] = []


@pytest.fixture
def servers() -> Iterator[tuple[str, str, _Seen]]:
    """An origin that wants ``TOKEN`` and redirects ``/moved/*`` to a second host."""
    seen = _Seen()
    other_url: list[str] = []

    async def make_other() -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            seen.other.append(dict(request.headers))
            return _ranged(request)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    async def make_origin() -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            seen.origin.append(dict(request.headers))
            if request.headers.get("Authorization") != TOKEN:
                return web.Response(status=401)
            if request.path.startswith("/moved/"):
                raise web.HTTPFound(other_url[0] + request.path)
            return _ranged(request)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    other = ServerThread(make_other, name="test-http-other")
    other.start()
    other_url.append(other.url)
    origin = ServerThread(make_origin, name="test-http-origin")
    origin.start()
    yield origin.url, other.url, seen
    origin.close()
    other.close()


def _ranged(request: web.Request) -> web.StreamResponse:
    rng = request.headers.get("Range")
    if request.method == "HEAD":
        return web.Response(headers={"Content-Length": str(len(DATA)), "ETag": '"e1"'})
    if rng:
        a, _, b = rng.removeprefix("bytes=").partition("-")
        end = int(b) + 1 if b else len(DATA)
        return web.Response(
            status=206,
            body=DATA[int(a) : end],
            headers={"Content-Range": f"bytes {a}-{end - 1}/{len(DATA)}"},
        )
    return web.Response(body=DATA)


async def test_headers_reach_origin_not_redirect_target_nor_logs(
    servers: tuple[str, str, _Seen], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    origin, _, seen = servers
    storage = open_storage(origin, Settings(timeout_s=5), {"headers": {"Authorization": TOKEN}})
    try:
        assert (await storage.head("a.bin")).size == len(DATA)
        assert await storage.read("a.bin", 10, 20) == DATA[10:20]
        assert await storage.read("moved/b.bin", 5, 9) == DATA[5:9]
        assert (await storage.head("moved/b.bin")).size == len(DATA)
    finally:
        await storage.close()
    assert all(h.get("Authorization") == TOKEN for h in seen.origin)
    assert len(seen.other) == 2  # the redirected GET and HEAD arrived ...
    assert all("Authorization" not in h for h in seen.other)  # ... without the token
    assert "tok-" not in repr(storage) and "Authorization" in repr(storage)
    assert "tok-" not in caplog.text


async def test_missing_or_wrong_header_is_auth_error_without_secret(
    servers: tuple[str, str, _Seen],
) -> None:
    origin, _, _ = servers
    bad = "Bearer wrong-" + "w" * 20
    for opts in ({}, {"headers": {"Authorization": bad}}):
        storage = open_storage(origin, Settings(timeout_s=5), opts)
        try:
            with pytest.raises(AuthError) as err:
                await storage.read("a.bin")
        finally:
            await storage.close()
        assert f"{origin}/a.bin" in str(err.value)
        assert "wrong-" not in str(err.value) and "wrong-" not in repr(err.value)
    assert "storage_options headers ['Authorization']" in str(err.value)


@pytest.mark.parametrize(
    "headers", [["Authorization"], {"X": 1}, {"X": "a\r\nInjected: 1"}, {"": "v"}]
)
def test_bad_headers_option_is_config_error(headers: object) -> None:
    with pytest.raises(ConfigError, match="headers") as err:
        open_storage("https://example.com/ds", Settings(), {"headers": headers})
    assert "Injected: 1" not in str(err.value)
