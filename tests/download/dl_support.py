"""Helpers for downloader tests: an in-memory storage, a small HTTP storage, an origin."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from asynccache.errors import AuthError, ObjectNotFoundError, StorageError, TransientError
from asynccache.storage.base import ObjectInfo, Storage
from asynccache.testing.faults import ServerThread


class DictStorage(Storage):
    """Objects served from a dict; records every ranged read; can inject failures."""

    def __init__(self, objects: dict[str, bytes], piece: int = 1 << 16) -> None:
        self.url = "mem://test"
        self.objects = objects
        self.piece = piece
        self.reads: list[tuple[str, int, int | None]] = []
        self.fail_next: list[BaseException] = []  # raised after yielding `short` bytes
        self.short = 0
        self.delay_s = 0.0

    async def _head_impl(self, key: str) -> ObjectInfo:
        if key not in self.objects:
            raise ObjectNotFoundError(f"{self.object_url(key)} not found", url=self.url)
        return ObjectInfo(key, len(self.objects[key]))

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        self.reads.append((key, start, end))
        if key not in self.objects:
            raise ObjectNotFoundError(f"{self.object_url(key)} not found", url=self.url)
        data = self.objects[key][start:end]
        if self.fail_next:
            exc = self.fail_next.pop(0)
            if self.short:
                yield data[: self.short]
            raise exc
        for i in range(0, len(data), self.piece):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield data[i : i + self.piece]

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        return [ObjectInfo(k, len(v)) for k, v in self.objects.items() if k.startswith(prefix)]

    async def _upload_impl(self, src: str, key: str) -> int:
        raise NotImplementedError

    async def _delete_impl(self, key: str) -> None:
        self.objects.pop(key, None)


class HttpStorage(Storage):
    """A minimal aiohttp-backed storage over plain HTTP, translating errors like a backend."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def _check(self, resp: aiohttp.ClientResponse, key: str) -> None:
        url = self.object_url(key)
        if resp.status == 404:
            raise ObjectNotFoundError(f"{url} not found", url=url)
        if resp.status in (401, 403):
            raise AuthError(f"{url}: access denied", url=url)
        if resp.status == 429 or resp.status >= 500:
            ra = resp.headers.get("Retry-After")
            raise TransientError(
                f"{url}: HTTP {resp.status}", url=url, retry_after=float(ra) if ra else None
            )
        if resp.status >= 400:
            raise StorageError(f"{url}: HTTP {resp.status}", url=url)

    async def _head_impl(self, key: str) -> ObjectInfo:
        try:
            async with self._s().head(self.object_url(key)) as resp:
                self._check(resp, key)
                return ObjectInfo(key, int(resp.headers["Content-Length"]))
        except aiohttp.ClientError as exc:
            raise TransientError(f"{self.object_url(key)}: {exc!r}") from exc

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        url = self.object_url(key)
        rng = f"bytes={start}-" + ("" if end is None else str(end - 1))
        got = 0
        try:
            async with self._s().get(url, headers={"Range": rng}) as resp:
                self._check(resp, key)
                async for piece in resp.content.iter_chunked(1 << 16):
                    got += len(piece)
                    yield piece
        except aiohttp.ClientError as exc:
            raise TransientError(f"{url}: {exc!r} after {got} bytes", url=url) from exc
        if end is not None and start + got < end:
            raise TransientError(f"{url}: short body ({got} bytes)", url=url)

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        raise NotImplementedError

    async def _upload_impl(self, src: str, key: str) -> int:
        raise NotImplementedError

    async def _delete_impl(self, key: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class Origin:
    """A static file server over ``directory`` (Range-capable) on a free loopback port."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = str(directory)

        async def make_app() -> web.Application:
            app = web.Application()
            app.router.add_static("/", self.directory)
            return app

        self._server = ServerThread(make_app, name="test-origin")
        self.url = ""

    def __enter__(self) -> Origin:
        self.url = self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()


def make_chunks(directory: str | os.PathLike[str], sizes: list[int], seed: int = 0) -> dict:
    """Write random chunk files; returns name -> (bytes, xxh3 hex)."""
    import random

    import xxhash

    rng = random.Random(seed)
    out = {}
    for i, size in enumerate(sizes):
        data = rng.randbytes(size)
        name = f"chunk-0-{i}.bin"
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
        out[name] = (data, xxhash.xxh3_64(data).hexdigest())
    return out
