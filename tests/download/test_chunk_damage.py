"""A chunk damaged on the way is downloaded again within the retry budget; a rewrite of
the dataset is named only when the object's size or ETag changed (or, where the ETag is
the MD5 of the bytes, when the bytes arrived intact and still differ from the index)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from asynccache.config import Settings
from asynccache.errors import ChecksumMismatchError, DatasetRewrittenError
from asynccache.read.source import DatasetSource
from asynccache.storage import open_storage
from asynccache.testing.faults import Fault, FaultProxy, ServerThread
from tests.remote_data import upload_dataset, write_dataset

pytestmark = pytest.mark.timeout(60)

N_ITEMS, PER_CHUNK = 12, 4


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = dict(
        cache_dir=str(tmp_path / "cache"),
        retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        timeout_s=5.0,
        progress=False,
        part_bytes=1 << 20,  # one GET per chunk: a GET is a download
    )
    base.update(kw)
    return Settings(**base)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "src", N_ITEMS, chunk_size=PER_CHUNK, pad=4000)


def _read_epoch(source: DatasetSource, originals: Path) -> None:
    """Every chunk, compared byte for byte with what the writer wrote."""
    for ci in range(source.index.num_chunks):
        path = source.acquire(ci)
        try:
            name = source.index.filename(ci)
            assert Path(path).read_bytes() == (originals / name).read_bytes(), name
        finally:
            source.release(ci)


def _put(url: str, options: dict[str, Any], path: Path, key: str) -> None:
    async def go() -> None:
        storage = open_storage(url, Settings(), options)
        try:
            await storage.upload(path, key)
        finally:
            await storage.close()

    asyncio.run(go())


def _gets(proxy: FaultProxy, name: str) -> int:
    return proxy.count("GET", name)


# -- damage -------------------------------------------------------------------------------


@pytest.mark.parametrize("times", [2, 3])
@pytest.mark.parametrize("where", ["http", "s3"])
def test_a_chunk_damaged_in_consecutive_gets_reads_correctly(
    src, tmp_path, http_origin, request, where: str, times: int
) -> None:
    if where == "http":
        upstream, url, options = http_origin(src).url, None, {}
    else:
        objstore, bucket = request.getfixturevalue("objstore"), request.getfixturevalue("bucket")
        url = upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)
        upstream, options = objstore.endpoint_url, dict(objstore.storage_options)
    name = "chunk-0-1.bin"
    with FaultProxy(upstream) as proxy:
        proxy.add_fault(Fault("flip", times=times, path=name, flip_at=1000))
        options = {**options, "endpoint_url": proxy.url} if url else options
        with DatasetSource(
            url or proxy.url, settings=_settings(tmp_path), storage_options=options
        ) as source:
            _read_epoch(source, src)
            assert source.stats.retries >= times
        assert proxy.fired("flip") == times
        assert _gets(proxy, name) == times + 1


def test_damaged_past_the_budget_is_damage_not_a_rewrite(src, tmp_path, http_origin) -> None:
    name = "chunk-0-1.bin"
    with FaultProxy(http_origin(src).url) as proxy:
        proxy.add_fault(Fault("flip", times=100, path=name, flip_at=1000))
        with (
            DatasetSource(proxy.url, settings=_settings(tmp_path, retries=2)) as source,
            pytest.raises(ChecksumMismatchError) as info,
        ):
            source.acquire(1)
        assert not isinstance(info.value, DatasetRewrittenError)
        message = str(info.value)
        assert f"{proxy.url}/{name}" in message and "3 downloads in a row" in message
        assert proxy.fired("flip") == 3 == _gets(proxy, name)


# -- rewrites -----------------------------------------------------------------------------


@pytest.mark.parametrize("grow", [1000, -1000], ids=["larger", "smaller"])
def test_a_chunk_rewritten_with_another_size_is_named_at_once(
    src, tmp_path, http_origin, grow: int
) -> None:
    served = tmp_path / "served"
    shutil.copytree(src, served)
    name = "chunk-0-1.bin"
    with FaultProxy(http_origin(served).url) as proxy:
        with DatasetSource(proxy.url, settings=_settings(tmp_path)) as source:
            old = (served / name).read_bytes()
            # Larger: other bytes too (an appended tail alone leaves the chunk's range as
            # it was, and that range is read as it was). Smaller: the same bytes, cut.
            new = bytes(b ^ 0x55 for b in old) + b"\0" * grow if grow > 0 else old[:grow]
            (served / name).write_bytes(new)  # the dataset rewritten after the index was read
            with pytest.raises(DatasetRewrittenError) as info:
                source.acquire(1)
        message = str(info.value)
        assert f"{proxy.url}/{name}" in message and "rewritten" in message
        assert f"now {len(new)} bytes, the index says {len(old)}" in message
        if grow > 0:
            assert _gets(proxy, name) == 1  # no download again: it can't help


class Replacing:
    """A real origin serving a dataset directory whose chunk ``name`` is replaced (same
    size, other bytes, a new ETag) right after the first HEAD of it: an object rewritten
    between two downloads of one reader."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        self.replaced = False
        self.server = ServerThread(self._app, name="test-replacing-origin")

    async def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        key = request.path.lstrip("/")
        path = self.root / key
        if not path.is_file():
            return web.Response(status=404)
        body = await asyncio.to_thread(path.read_bytes)
        etag = '"v1"'
        if key == self.name:
            if self.replaced:
                body, etag = bytes(b ^ 0x55 for b in body), '"v2"'
            elif request.method == "HEAD":
                self.replaced = True  # after this answer, the object is the new one
        headers = {"ETag": etag}
        if request.method == "HEAD":
            resp = web.StreamResponse(headers=headers)
            resp.content_length = len(body)
            await resp.prepare(request)
            return resp
        rng = request.headers.get("Range")
        if rng:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            end = min(len(body), int(b) + 1) if b else len(body)
            headers["Content-Range"] = f"bytes {a}-{end - 1}/{len(body)}"
            return web.Response(status=206, body=body[int(a) : end], headers=headers)
        return web.Response(body=body, headers=headers)


@pytest.fixture
def replacing(src) -> Iterator[Replacing]:
    origin = Replacing(src, "chunk-0-1.bin")
    origin.server.start()
    yield origin
    origin.server.close()


def test_an_etag_changed_between_two_downloads_is_a_rewrite(replacing, tmp_path) -> None:
    name = replacing.name
    with FaultProxy(replacing.server.url) as proxy:
        # The first download is damaged on the way; the object is replaced before the
        # second (same size, other bytes), which therefore differs from the index too.
        proxy.add_fault(Fault("flip", times=1, path=name, flip_at=1000))
        with (
            DatasetSource(proxy.url, settings=_settings(tmp_path)) as source,
            pytest.raises(DatasetRewrittenError) as info,
        ):
            source.acquire(1)
        assert proxy.fired("flip") == 1 and replacing.replaced
        assert _gets(proxy, name) == 2
    message = str(info.value)
    assert f"{proxy.url}/{name}" in message
    assert 'ETag went from "v1" to "v2"' in message


def test_s3_same_size_rewrite_is_named_from_its_md5_etag(src, tmp_path, objstore, bucket):
    """Where the ETag is the MD5 of the stored bytes, bytes that arrive intact (their MD5
    is the ETag) and differ from the index are a rewrite: named after one download."""
    url = upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)
    name = "chunk-0-1.bin"
    with FaultProxy(objstore.endpoint_url) as proxy:
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        with DatasetSource(url, settings=_settings(tmp_path), storage_options=options) as source:
            other = tmp_path / "other"
            other.mkdir()
            (other / name).write_bytes(bytes(b ^ 0x55 for b in (src / name).read_bytes()))
            _put(url, objstore.storage_options, other / name, name)  # same size, other bytes
            with pytest.raises(DatasetRewrittenError) as info:
                source.acquire(1)
        assert _gets(proxy, name) == 1
    assert f"{url}/{name}" in str(info.value) and "MD5" in str(info.value)
