"""One conformance suite that every storage backend runs (file, http, s3, gs, az, hf).

Each backend is served by a real server on loopback (SeaweedFS for s3, fake-gcs-server
for gs, Azurite for az, aiohttp.web for http, an aiohttp.web Hub imitation for hf) and
seeded with the same objects before each test.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asynccache.config import Settings
from asynccache.errors import ObjectNotFoundError, StorageError
from asynccache.storage import Storage, open_storage

pytestmark = pytest.mark.timeout(60)

_rng = random.Random(1234)
SEED: dict[str, bytes] = {
    "a.bin": _rng.randbytes(300_000),
    "dir/b.bin": _rng.randbytes(2_500_000),
    "dir/sub/c.txt": b"hello world\n",
    "empty.bin": b"",
}


@dataclasses.dataclass
class Backend:
    name: str
    storage: Storage
    writable: bool
    listable: bool


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


@pytest.fixture(params=["file", "http", "s3", "gs", "az", "hf"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    settings = Settings(timeout_s=10.0)
    kind = request.param
    if kind == "file":
        root = tmp_path / "root"
        _write_tree(root, SEED)
        storage = open_storage(root.as_uri(), settings)
        yield Backend(kind, storage, writable=True, listable=True)
    elif kind == "http":
        _write_tree(tmp_path / "site", SEED)
        server = request.getfixturevalue("http_origin")(tmp_path / "site")
        storage = open_storage(server.url + "/", settings)
        yield Backend(kind, storage, writable=False, listable=False)
    elif kind == "hf":
        hub = request.getfixturevalue("hub")
        hub.commit("org/data", {f"ds/{k}": v for k, v in SEED.items()} | {"other.bin": b"x"})
        storage = open_storage("hf://datasets/org/data/ds", settings, {"endpoint_url": hub.url})
        yield Backend(kind, storage, writable=False, listable=True)
    elif kind in ("gs", "az"):
        if kind == "gs":
            emulator = request.getfixturevalue("gcs_emulator")
            root = f"gs://{request.getfixturevalue('gcs_bucket')}/ds"
        else:
            emulator = request.getfixturevalue("azurite")
            root = f"az://{request.getfixturevalue('az_container')}/ds"
        storage = open_storage(root, settings, emulator.storage_options)
        _write_tree(tmp_path / "seed", SEED)
        for key in SEED:
            await storage.upload(tmp_path / "seed" / key, key)
        yield Backend(kind, storage, writable=True, listable=True)
    else:
        store = request.getfixturevalue("objstore")
        bucket = request.getfixturevalue("bucket")
        storage = open_storage(f"s3://{bucket}/ds", settings, store.storage_options)
        _write_tree(tmp_path / "seed", SEED)
        for key in SEED:
            await storage.upload(tmp_path / "seed" / key, key)
        yield Backend(kind, storage, writable=True, listable=True)
    await storage.close()
    await storage.close()  # idempotent


async def test_head(backend: Backend) -> None:
    for key, data in SEED.items():
        info = await backend.storage.head(key)
        assert (info.key, info.size) == (key, len(data))


async def test_head_missing_names_url(backend: Backend) -> None:
    with pytest.raises(ObjectNotFoundError) as err:
        await backend.storage.head("nope/missing.bin")
    assert backend.storage.object_url("nope/missing.bin") in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (0, None),
        (0, 1),
        (10, 20),
        (100_000, None),
        (299_995, 300_000),
        (7, 7),
        (0, 300_000),
        (299_990, 400_000),  # end past the object: the bytes that exist
        (300_000, None),  # start at the end: nothing
        (400_000, 500_000),  # wholly past the end: nothing
    ],
)
async def test_iter_range(backend: Backend, start: int, end: int | None) -> None:
    got = b"".join([p async for p in backend.storage.iter_range("a.bin", start, end)])
    assert got == SEED["a.bin"][start:end]


async def test_iter_range_streams_in_pieces(backend: Backend) -> None:
    pieces = [p async for p in backend.storage.iter_range("dir/b.bin")]
    assert len(pieces) > 1
    assert b"".join(pieces) == SEED["dir/b.bin"]


async def test_abandoned_stream_then_reuse(backend: Backend) -> None:
    gen = backend.storage.iter_range("dir/b.bin")
    first = await gen.__anext__()
    assert first == SEED["dir/b.bin"][: len(first)]
    await gen.aclose()
    assert await backend.storage.read("dir/sub/c.txt") == SEED["dir/sub/c.txt"]


class _Sink:
    """Takes at most ``limit`` bytes, then asks for no more (a part cut short)."""

    def __init__(self, limit: int) -> None:
        self.got = bytearray()
        self.limit = limit

    def write(self, data: bytes | memoryview, /) -> bool:
        self.got += data[: self.limit - len(self.got)]
        return len(self.got) < self.limit

    def closing(self) -> None:
        pass


async def test_receive_into(backend: Backend) -> None:
    data = SEED["dir/b.bin"]
    for start, end in [
        (0, len(data)),
        (10, 20),
        (1_000_000, 2_400_001),
        (len(data) - 5, len(data) + 9),
    ]:
        sink = _Sink(1 << 30)
        await backend.storage.receive_into("dir/b.bin", start, end, sink)
        assert sink.got == data[start:end], (start, end)
    cut = _Sink(70_000)  # stops wanting bytes mid-body: the request ends there
    await backend.storage.receive_into("dir/b.bin", 0, len(data), cut)
    assert cut.got == data[:70_000]
    with pytest.raises(ObjectNotFoundError, match="nope"):
        await backend.storage.receive_into("nope.bin", 0, 10, _Sink(10))
    assert await backend.storage.read("dir/sub/c.txt") == SEED["dir/sub/c.txt"]


async def test_read(backend: Backend) -> None:
    assert await backend.storage.read("dir/sub/c.txt") == b"hello world\n"
    assert await backend.storage.read("dir/b.bin", 1000, 2000) == SEED["dir/b.bin"][1000:2000]
    assert await backend.storage.read("empty.bin") == b""


async def test_read_missing(backend: Backend) -> None:
    with pytest.raises(ObjectNotFoundError):
        await backend.storage.read("missing.bin")


async def test_download(backend: Backend, tmp_path: Path) -> None:
    dest = tmp_path / "out.bin"
    assert await backend.storage.download("dir/b.bin", dest) == len(SEED["dir/b.bin"])
    assert dest.read_bytes() == SEED["dir/b.bin"]


async def test_list(backend: Backend) -> None:
    if not backend.listable:
        with pytest.raises(StorageError, match="not supported"):
            await backend.storage.list()
        return
    every = await backend.storage.list()
    assert [(o.key, o.size) for o in every] == sorted((k, len(v)) for k, v in SEED.items())
    assert [o.key for o in await backend.storage.list("dir/")] == ["dir/b.bin", "dir/sub/c.txt"]
    assert await backend.storage.list("zzz") == []


async def test_list_paginates(backend: Backend) -> None:
    if backend.name not in ("s3", "gs", "az"):
        pytest.skip("pagination is an object-store notion")
    storage = backend.storage
    storage.list_page_size = 1  # type: ignore[attr-defined]
    pages = 0

    async def counting(*args: object, **kwargs: object) -> object:
        nonlocal pages
        pages += 1
        return await send(*args, **kwargs)

    send = getattr(storage, "request", None) or storage._request  # type: ignore[attr-defined]
    name = "request" if hasattr(storage, "request") else "_request"
    setattr(storage, name, counting)
    every = await storage.list()
    assert [o.key for o in every] == sorted(SEED)
    assert pages == len(SEED)


@pytest.mark.parametrize("size", [0, 1000, 12 << 20])
async def test_upload_and_read_back(backend: Backend, tmp_path: Path, size: int) -> None:
    src = tmp_path / "src.bin"
    data = os.urandom(size)
    src.write_bytes(data)
    if not backend.writable:
        with pytest.raises(StorageError, match="read-only"):
            await backend.storage.upload(src, "new/obj.bin")
        return
    assert await backend.storage.upload(src, "new/obj.bin") == size
    assert (await backend.storage.head("new/obj.bin")).size == size
    assert await backend.storage.read("new/obj.bin") == data


async def test_multipart_upload(backend: Backend, tmp_path: Path) -> None:
    if backend.name != "s3":
        pytest.skip("multipart is an S3 notion")
    storage = backend.storage
    store = pytest.importorskip("asynccache.storage.s3")
    assert isinstance(storage, store.S3Storage)
    storage.multipart_threshold = 6 << 20
    storage.part_size = 5 << 20
    data = os.urandom((5 << 20) * 2 + 12345)
    (tmp_path / "big.bin").write_bytes(data)
    assert await storage.upload(tmp_path / "big.bin", "big.bin") == len(data)
    info = await storage.head("big.bin")
    assert info.size == len(data)
    assert info.etag is not None and info.etag.strip('"').endswith("-3")  # three parts
    assert (
        await storage.read("big.bin", (5 << 20) - 10, (5 << 20) + 10)
        == data[(5 << 20) - 10 : (5 << 20) + 10]
    )


async def test_upload_replaces(backend: Backend, tmp_path: Path) -> None:
    if not backend.writable:
        pytest.skip("read-only backend")
    (tmp_path / "v.bin").write_bytes(b"second version")
    await backend.storage.upload(tmp_path / "v.bin", "a.bin")
    assert await backend.storage.read("a.bin") == b"second version"


async def test_delete(backend: Backend) -> None:
    if not backend.writable:
        with pytest.raises(StorageError, match="read-only"):
            await backend.storage.delete("a.bin")
        return
    await backend.storage.delete("a.bin")
    with pytest.raises(ObjectNotFoundError):
        await backend.storage.head("a.bin")
    await backend.storage.delete("a.bin")  # missing: not an error


async def test_upload_missing_source(backend: Backend, tmp_path: Path) -> None:
    if not backend.writable:
        pytest.skip("read-only backend")
    with pytest.raises(ObjectNotFoundError):
        await backend.storage.upload(tmp_path / "absent.bin", "x.bin")


async def test_local_path_and_is_local(backend: Backend) -> None:
    if backend.name == "file":
        assert backend.storage.is_local
        path = backend.storage.local_path("dir/b.bin")
        assert path is not None and _read(path) == SEED["dir/b.bin"]
    else:
        assert not backend.storage.is_local
        assert backend.storage.local_path("a.bin") is None


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
async def test_bad_keys(backend: Backend, key: str) -> None:
    from asynccache.errors import ConfigError

    with pytest.raises(ConfigError):
        await backend.storage.head(key)
