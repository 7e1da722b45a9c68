"""index.json is bounded (ASYNCCACHE_MAX_INDEX_BYTES), its sidecar by what index.json
states: an oversized one is refused without being read whole, and without retries."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from asynccache.cache.indexfile import read_path, read_storage
from asynccache.config import Settings
from asynccache.errors import BadIndexError
from asynccache.format.columns import max_size
from asynccache.format.index import seal
from asynccache.read.source import DatasetSource
from asynccache.storage import open_storage
from asynccache.testing.faults import FaultProxy, ServerThread
from tests.remote_data import write_dataset

pytestmark = pytest.mark.timeout(60)

BODY = 256 << 20  # what the server offers; never allocated on either side
BOUND = 1 << 20
_BLOCK = b" " * (1 << 20)


class Endless:
    """A real server whose ``/index.json`` is ``BODY`` bytes of spaces, made as they are
    sent. Counts the body bytes it handed to the socket, and each request."""

    def __init__(self, honour_range: bool) -> None:
        self.honour_range = honour_range
        self.sent = 0
        self.requests: list[tuple[str, str | None]] = []
        self.done = threading.Event()
        self.server = ServerThread(self._app, name="test-endless-index")

    async def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rng = request.headers.get("Range")
        self.requests.append((request.method, rng))
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": str(BODY)})
        length, status, headers = BODY, 200, {}
        if self.honour_range and rng:
            first, _, last = rng.removeprefix("bytes=").partition("-")
            end = min(BODY, int(last) + 1) if last else BODY
            length, status = end - int(first), 206
            headers["Content-Range"] = f"bytes {first}-{end - 1}/{BODY}"
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = length
        await resp.prepare(request)
        try:
            left = length
            while left > 0:
                piece = _BLOCK[: min(left, len(_BLOCK))]
                await resp.write(piece)
                self.sent += len(piece)
                left -= len(piece)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client cut the body off: what it was meant to do
        finally:
            self.done.set()
        return resp


@pytest.fixture(params=[False, True], ids=["range-ignored", "range-honoured"])
def endless(request) -> Iterator[Endless]:
    server = Endless(honour_range=request.param)
    server.server.start()
    yield server
    server.server.close()


def test_an_endless_index_is_cut_off_and_refused_once(endless: Endless, tmp_path: Path) -> None:
    settings = Settings(
        cache_dir=str(tmp_path / "cc"),
        max_index_bytes=BOUND,
        retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        timeout_s=10.0,
        progress=False,
    )
    with pytest.raises(BadIndexError) as info:
        DatasetSource(endless.server.url, settings=settings)
    message = str(info.value)
    assert f"{endless.server.url}/index.json" in message
    assert str(BODY) in message and str(BOUND) in message  # its size and the bound
    assert "ASYNCCACHE_MAX_INDEX_BYTES" in message
    gets = [r for r in endless.requests if r[0] == "GET"]
    assert len(gets) == 1  # not retried
    assert gets[0][1] == f"bytes=0-{BOUND}"  # asked for one byte past the bound
    assert endless.done.wait(10)
    # Cut off: the server got rid of a few socket buffers' worth, not the body.
    assert endless.sent < 32 << 20, endless.sent


def test_a_sidecar_larger_than_its_index_allows_is_never_fetched(tmp_path, http_origin) -> None:
    src = write_dataset(tmp_path / "src", 10, chunk_size=4)
    doc = json.loads((src / "index.json").read_bytes())
    assert doc["version"] == 2
    doc.pop("index_checksum")
    doc["columns"]["bytes"] = 8 << 30  # an absurd sidecar for 3 chunks
    (src / "index.json").write_text(seal(json.dumps(doc, indent=1, sort_keys=True) + "\n"))
    server = http_origin(src)
    settings = Settings(cache_dir=str(tmp_path / "cc"), progress=False)
    with FaultProxy(server.url) as proxy:
        with pytest.raises(BadIndexError, match=r"index-[0-9a-f]{16}\.cols") as info:
            DatasetSource(proxy.url, settings=settings)
        fields = len(doc["names"]["pattern"]) - 1 if doc.get("names") else None
        most = max_size(doc["chunks"], doc["total_items"], fields)
        assert str(8 << 30) in str(info.value) and str(most) in str(info.value)
        assert proxy.count("GET", ".cols") == 0
        assert proxy.count("GET", "index.json") == 1
    with pytest.raises(BadIndexError, match="at most"):
        read_path(str(src / "index.json"))


def test_a_large_local_index_is_refused_by_its_size(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    with open(path, "wb") as f:
        f.truncate(BODY)  # sparse: nothing is written
    with pytest.raises(BadIndexError, match="ASYNCCACHE_MAX_INDEX_BYTES") as info:
        read_path(str(path), max_bytes=BOUND)
    assert str(BODY) in str(info.value)


def test_tools_reading_an_index_are_bounded(endless: Endless, tmp_path: Path) -> None:
    settings = Settings(cache_dir=str(tmp_path / "cc"), timeout_s=10.0)

    async def go() -> None:
        storage = open_storage(endless.server.url, settings)
        try:
            await read_storage(storage, max_bytes=BOUND)
        finally:
            await storage.close()

    with pytest.raises(BadIndexError, match="ASYNCCACHE_MAX_INDEX_BYTES"):
        asyncio.run(go())
    assert endless.done.wait(10)
    assert endless.sent < 32 << 20, endless.sent
