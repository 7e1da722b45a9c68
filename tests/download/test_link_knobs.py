"""The fault proxy's link knobs: first-byte latency and a per-connection bandwidth cap.

Each knob is checked by a lower bound on elapsed time (what it must at least cost) and by
its fired count, never by an upper bound on speed.
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest
from aiohttp import web

from asynccache.errors import ConfigError
from asynccache.testing.faults import FaultProxy, ServerThread

pytestmark = pytest.mark.timeout(30)

BODY = os.urandom(200_000)


@pytest.fixture(scope="module")
def origin():
    async def make_app() -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            return web.Response(body=BODY)

        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        return app

    server = ServerThread(make_app, name="test-link-origin")
    server.start()
    yield server
    server.close()


async def _get(url: str, n: int = 1, parallel: bool = False) -> list[tuple[float, float, bytes]]:
    """(seconds to the response headers, seconds to the end, body) of ``n`` GETs."""

    async def one(session: aiohttp.ClientSession) -> tuple[float, float, bytes]:
        t0 = time.monotonic()
        async with session.get(f"{url}/obj") as r:
            first = time.monotonic() - t0
            body = await r.read()
        return first, time.monotonic() - t0, body

    async with aiohttp.ClientSession() as s:
        if parallel:
            return list(await asyncio.gather(*(one(s) for _ in range(n))))
        return [await one(s) for _ in range(n)]


def test_latency_delays_every_request_before_its_first_byte(origin) -> None:
    with FaultProxy(origin.url, latency_s=0.15) as proxy:
        got = asyncio.run(_get(proxy.url, n=3))
        assert proxy.link_fired("latency") == 3
        assert proxy.link_fired("cap") == 0
        proxy.set_link(latency_s=0)
        asyncio.run(_get(proxy.url))
        assert proxy.link_fired("latency") == 3  # turned off: no more delays
    for first, _, body in got:
        assert first >= 0.15
        assert body == BODY


def test_bandwidth_cap_paces_each_connection(origin) -> None:
    cap = 400_000  # bytes/s: the 200 kB body takes at least 0.5 s on each connection
    with FaultProxy(origin.url) as proxy:
        proxy.set_link(conn_bytes_per_s=cap)
        got = asyncio.run(_get(proxy.url, n=2, parallel=True))
        assert proxy.link_fired("cap") == 2  # both connections were held back
        assert proxy.link_fired("latency") == 0
    for _, total, body in got:
        assert body == BODY
        assert total >= len(BODY) / cap


def test_link_knobs_reject_negative_values(origin) -> None:
    with pytest.raises(ConfigError, match="latency_s"):
        FaultProxy(origin.url, latency_s=-1)
    with FaultProxy(origin.url) as proxy, pytest.raises(ConfigError, match="conn_bytes_per_s"):
        proxy.set_link(conn_bytes_per_s=-5)
