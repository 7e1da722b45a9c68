"""The fault proxy itself: transparent forwarding and the request log."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from asynccache.testing.faults import Fault, FaultProxy, ServerThread

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def echo():
    async def make_app() -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            return web.json_response(
                {"headers": dict(request.headers), "path": request.path_qs, "body": len(body)}
            )

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    server = ServerThread(make_app, name="test-echo")
    server.start()
    yield server
    server.close()


def test_forwards_signed_headers_and_host_unchanged(echo) -> None:
    sent = {
        "Authorization": "AWS4-HMAC-SHA256 Credential=AK/20260101/us-east-1/s3/aws4_request",
        "x-amz-date": "20260101T000000Z",
        "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
        "Range": "bytes=5-9",
        "Host": "bucket.example:1234",
    }

    async def go(url: str) -> dict:
        async with (
            aiohttp.ClientSession() as s,
            s.put(f"{url}/b/k%20ey?x-id=1", headers=sent, data=b"abc") as r,
        ):
            return await r.json()

    with FaultProxy(echo.url) as proxy:
        got = asyncio.run(go(proxy.url))
        assert proxy.requests[0].method == "PUT"
        assert proxy.requests[0].range == "bytes=5-9"
    for key, value in sent.items():
        assert got["headers"][key] == value
    assert got["path"] == "/b/k%20ey?x-id=1" and got["body"] == 3


def test_status_faults_are_consumed_in_order(echo) -> None:
    async def go(url: str) -> list[tuple[int, str | None]]:
        out = []
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.get(f"{url}/x") as r:
                    out.append((r.status, r.headers.get("Retry-After")))
        return out

    with FaultProxy(echo.url) as proxy:
        proxy.add_fault(Fault("status", times=2, status=503))
        proxy.add_fault(Fault("status", status=429, retry_after=1.5))
        assert asyncio.run(go(proxy.url)) == [(503, None), (503, None), (429, "1.5"), (200, None)]
        assert [r.fault for r in proxy.requests] == ["status", "status", "status", None]
        assert proxy.count("GET", "/x") == 4
