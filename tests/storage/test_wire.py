"""Our own receive path (storage/wire.py) against aiohttp's, on real servers and faults.

Every case runs ``Storage.receive_into`` both ways (``ASYNCCACHE_RECEIVE=direct`` and
``aiohttp``) on the same fault and checks the same bytes and the same error class naming
the URL; fault cases also check that the fault fired. Keep-alive and fork cases look at
the direct pool's own connections and at the peers the proxy saw.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from asynccache.config import Settings
from asynccache.errors import (
    AsyncCacheError,
    ObjectNotFoundError,
    StorageError,
    StorageTimeoutError,
    TransientError,
)
from asynccache.storage import open_storage
from asynccache.storage.base import Storage
from asynccache.storage.wire import DirectPool
from asynccache.testing.faults import Fault, FaultProxy

pytestmark = pytest.mark.timeout(60)

PATHS = ("direct", "aiohttp")
SIZE = 300_000
DATA = bytes((i * 7 + i // 251) & 0xFF for i in range(SIZE))


class _Sink:
    """Collects bytes up to ``end`` (which a test may move down: a cut)."""

    def __init__(self, end: int) -> None:
        self.got = bytearray()
        self.end = end
        self.closings = 0

    def write(self, data: bytes | memoryview, /) -> bool:
        room = self.end - len(self.got)
        self.got += data[: max(0, room)]
        return len(self.got) < self.end

    def closing(self) -> None:
        self.closings += 1


async def _receive(
    storage: Storage, key: str, start: int, end: int, *, cut: int | None = None
) -> tuple[bytes, BaseException | None]:
    sink = _Sink(end - start if cut is None else cut)
    try:
        await storage.receive_into(key, start, end, sink)
    except AsyncCacheError as exc:
        return bytes(sink.got), exc
    return bytes(sink.got), None


def _pool(storage: Storage) -> DirectPool:
    pool = storage.session_holder.direct() if hasattr(storage, "session_holder") else None
    if pool is None:
        pool = storage._sessions.direct()  # type: ignore[attr-defined]
    assert pool is not None
    return pool


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    (d / "obj.bin").write_bytes(DATA)
    return d


def _open(url: str, receive: str, **kw: object) -> Storage:
    return open_storage(url, Settings(receive=receive, timeout_s=kw.pop("timeout_s", 5.0)), kw)


FAULTS = {
    "reset mid-body": (Fault("reset", after_bytes=100_000), "reset", TransientError),
    "truncated body": (Fault("truncate", after_bytes=100_000), "truncate", TransientError),
    "503": (Fault("status", status=503, retry_after=2), "status", TransientError),
    "stall": (Fault("stall", after_bytes=50_000, stall_s=30), "stall", StorageTimeoutError),
}


@pytest.mark.parametrize("name", list(FAULTS))
async def test_fault_gives_the_same_bytes_and_error_both_ways(
    name: str, src: Path, http_origin: Callable[..., object]
) -> None:
    fault, kind, error = FAULTS[name]
    origin = http_origin(src)
    outcomes = {}
    for receive in PATHS:
        with FaultProxy(origin.url) as proxy:  # type: ignore[attr-defined]
            proxy.add_fault(Fault(**{**fault.__dict__}))
            storage = _open(proxy.url, receive, timeout_s=0.5 if kind == "stall" else 5.0)
            try:
                got, exc = await _receive(storage, "obj.bin", 1000, SIZE)
                if receive == "direct":  # received here, not handed to aiohttp
                    assert _pool(storage).connects == 1 and _pool(storage).handed_back == 0
            finally:
                await storage.close()
            assert proxy.fired(kind) == 1, receive  # the fault really happened
        assert isinstance(exc, error), (receive, exc)
        assert f"{proxy.url}/obj.bin" in str(exc)
        assert DATA[1000 : 1000 + len(got)] == got  # what came is right, in order
        outcomes[receive] = (type(exc), getattr(exc, "retry_after", None))
    assert outcomes["direct"] == outcomes["aiohttp"]


@pytest.mark.parametrize("receive", PATHS)
async def test_missing_object_and_ranges(
    receive: str, src: Path, http_origin: Callable[..., object]
) -> None:
    with FaultProxy(http_origin(src).url) as proxy:  # type: ignore[attr-defined]
        storage = _open(proxy.url, receive)
        try:
            got, exc = await _receive(storage, "nope.bin", 0, 10)
            assert isinstance(exc, ObjectNotFoundError) and "nope.bin" in str(exc)
            assert got == b""
            assert (await _receive(storage, "obj.bin", 5, 70_005)) == (DATA[5:70_005], None)
            assert (await _receive(storage, "obj.bin", SIZE - 7, SIZE)) == (DATA[-7:], None)
            # A range past the end gives nothing, as slicing does.
            assert (await _receive(storage, "obj.bin", SIZE, SIZE + 10)) == (b"", None)
            # An end past the object's: what there is.
            assert (await _receive(storage, "obj.bin", SIZE - 3, SIZE + 10)) == (DATA[-3:], None)
        finally:
            await storage.close()
        assert proxy.count("GET") == 5  # one request each, none sent twice


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[RawHandler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: RawHandler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5)


@pytest.mark.parametrize("receive", PATHS)
async def test_200_to_a_range_is_trimmed_and_short_body_is_transient(
    receive: str, raw_server: Callable[[RawHandler], Awaitable[str]]
) -> None:
    answered: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"split" in head:  # the head across two reads
            writer.write(b"HTTP/1.1 206 Partial Content\r\nContent-")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"Length: 5\r\n\r\nhello")
        elif b"short" in head:
            writer.write(
                b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\n\r\n" + b"x" * 400
            )
        else:  # ignores Range: the whole object
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789")
        answered.append(head)
        await writer.drain()
        writer.close()

    storage = _open(await raw_server(handler), receive)
    try:
        assert await _receive(storage, "obj", 3, 6) == (b"345", None)
        assert await _receive(storage, "split", 0, 5) == (b"hello", None)
        got, exc = await _receive(storage, "short", 0, 1000)
    finally:
        await storage.close()
    assert len(answered) == 3 and b"Range: bytes=3-5" in answered[0]  # the faults fired
    assert got == b"x" * 400
    assert isinstance(exc, TransientError) and "short" in str(exc)


async def test_keep_alive_after_a_whole_body_not_after_a_cut(
    src: Path, http_origin: Callable[..., object]
) -> None:
    with FaultProxy(http_origin(src).url) as proxy:  # type: ignore[attr-defined]
        storage = _open(proxy.url, "direct")
        pool = _pool(storage)
        try:
            assert await _receive(storage, "obj.bin", 0, 1000) == (DATA[:1000], None)
            assert await _receive(storage, "obj.bin", 1000, 2000) == (DATA[1000:2000], None)
            assert pool.connects == 1 and pool.idle() == 1  # the same connection, twice
            # A cut: the sink stops wanting bytes mid-body; the connection is closed.
            got, exc = await _receive(storage, "obj.bin", 0, SIZE, cut=5000)
            assert exc is None and got == DATA[:5000]
            assert pool.idle() == 0
            assert await _receive(storage, "obj.bin", 0, 10) == (DATA[:10], None)
            assert pool.connects == 2
        finally:
            await storage.close()
        peers = [r.peer for r in proxy.requests]
    assert peers[0] == peers[1] == peers[2] != peers[3]


async def test_forked_child_does_not_reuse_the_parents_connections(
    src: Path, http_origin: Callable[..., object]
) -> None:
    with FaultProxy(http_origin(src).url) as proxy:  # type: ignore[attr-defined]
        storage = _open(proxy.url, "direct")
        pool = _pool(storage)
        try:
            assert await _receive(storage, "obj.bin", 0, 100) == (DATA[:100], None)
            assert pool.idle() == 1
            pid = os.fork()
            if pid == 0:  # the child: a loop of its own, the parent's socket untouched
                code = 1
                try:
                    ok = pool.idle() == 0 and asyncio.run(_receive(storage, "obj.bin", 0, 100)) == (
                        DATA[:100],
                        None,
                    )
                    code = 0 if ok and pool.connects == 2 else 3
                finally:
                    os._exit(code)
            done = await asyncio.wait_for(asyncio.to_thread(os.waitpid, pid, 0), 30)
            assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
            # The parent's connection still serves the parent.
            assert await _receive(storage, "obj.bin", 100, 200) == (DATA[100:200], None)
            assert pool.connects == 1
        finally:
            await storage.close()
        peers = [r.peer for r in proxy.requests]
    assert len(peers) == 3 and peers[0] == peers[2] != peers[1]


async def test_s3_both_ways(objstore, bucket: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "obj.bin").write_bytes(DATA)
    for receive in PATHS:
        storage = open_storage(
            f"s3://{bucket}/ds", Settings(receive=receive), objstore.storage_options
        )
        try:
            if receive == "direct":
                await storage.upload(tmp_path / "obj.bin", "obj.bin")
            assert await _receive(storage, "obj.bin", 7, SIZE - 9) == (DATA[7 : SIZE - 9], None)
            _, exc = await _receive(storage, "missing.bin", 0, 10)
            assert isinstance(exc, ObjectNotFoundError) and "missing.bin" in str(exc)
            assert "NoSuchKey" in str(exc)  # the error body was read and mapped
            pool = storage.session_holder.direct()  # type: ignore[attr-defined]
            assert (pool is not None and pool.connects == 1) == (receive == "direct")
        finally:
            await storage.close()


@pytest.fixture(scope="module")
def tls_origin_ctx(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


async def test_https_both_ways(
    src: Path, http_origin: Callable[..., object], tls_origin_ctx: ssl.SSLContext
) -> None:
    server = http_origin(src, tls=tls_origin_ctx)
    url = server.url  # type: ignore[attr-defined]
    assert url.startswith("https://")
    for receive in PATHS:
        checked = _open(url, receive)
        unchecked = _open(url, receive, verify=False)
        try:
            _, exc = await _receive(checked, "obj.bin", 0, 100)
            assert isinstance(exc, StorageError) and not isinstance(exc, TransientError)
            assert "verify" in str(exc) and url in str(exc)
            assert await _receive(unchecked, "obj.bin", 10, SIZE) == (DATA[10:], None)
            assert await _receive(unchecked, "obj.bin", 0, 10) == (DATA[:10], None)
            if receive == "direct":
                assert _pool(unchecked).connects == 1  # TLS connection kept alive
        finally:
            await checked.close()
            await unchecked.close()
