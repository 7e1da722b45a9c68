"""The loopback servers themselves, and what the backends send them."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from asynccache.config import Settings
from asynccache.errors import BridgeError
from asynccache.storage import open_storage
from asynccache.testing import ObjectStore, StaticHTTPServer
from asynccache.testing.objstore import remove_sockets

pytestmark = pytest.mark.timeout(60)


def test_objstore_lifecycle_and_pid() -> None:
    with ObjectStore() as store:
        pid = store.pid
        assert Path(f"/proc/{pid}/stat").read_text().split()[0] == str(pid)
        assert store.endpoint_url.startswith("http://127.0.0.1:")
        assert store.env["AWS_ENDPOINT_URL"] == store.endpoint_url
        assert store.storage_options["aws_access_key_id"] == store.access_key
        assert store.secret_key not in repr(store)
        store.create_bucket("lifecycle")
        store.create_bucket("lifecycle")  # already there: fine
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError):
        _ = store.pid
    store.stop()  # idempotent


async def test_http_sends_range_and_head(tmp_path: Path) -> None:
    (tmp_path / "obj.bin").write_bytes(bytes(range(256)) * 100)
    with StaticHTTPServer(tmp_path) as server:
        storage = open_storage(server.url, Settings())
        try:
            assert (await storage.head("obj.bin")).size == 25_600
            assert await storage.read("obj.bin", 10, 20) == bytes(range(10, 20))
            assert await storage.read("obj.bin", 25_590) == bytes(range(246, 256))
        finally:
            await storage.close()
    assert [(r.method, r.path, r.range) for r in server.requests] == [
        ("HEAD", "/obj.bin", None),
        ("GET", "/obj.bin", "bytes=10-19"),
        ("GET", "/obj.bin", "bytes=25590-"),
    ]


async def test_one_pool_per_backend_sized_by_settings(objstore: ObjectStore, bucket: str) -> None:
    storage = open_storage(f"s3://{bucket}", Settings(max_concurrency=3), objstore.storage_options)
    try:
        await storage.list()
        session = storage.session_holder.get()  # type: ignore[attr-defined]
        await storage.list()
        assert storage.session_holder.get() is session  # type: ignore[attr-defined]
        assert session.connector is not None and session.connector.limit == 3
    finally:
        await storage.close()
    assert session.closed


def test_backend_is_bound_to_its_loop(objstore: ObjectStore, bucket: str) -> None:
    import asyncio

    storage = open_storage(f"s3://{bucket}", Settings(), objstore.storage_options)

    async def use() -> None:
        await storage.list()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(use())
        with pytest.raises(BridgeError, match="another event loop"):
            asyncio.run(use())
    finally:
        loop.run_until_complete(storage.close())
        loop.close()


def test_backends_do_not_read_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    storage = open_storage("s3://bkt/p", Settings(), aws_env={})
    assert storage.endpoint == "https://s3.us-east-1.amazonaws.com"  # type: ignore[attr-defined]
    assert storage.signer.region == "us-east-1"  # type: ignore[attr-defined]


async def test_failed_multipart_upload_is_aborted(
    objstore: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    from asynccache.errors import ObjectNotFoundError, StorageError
    from asynccache.storage import S3Storage
    from asynccache.storage.s3_multipart import upload_multipart

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(6 << 20))
    storage = open_storage(f"s3://{bucket}", Settings(), objstore.storage_options)
    assert isinstance(storage, S3Storage)
    storage.part_size = 5 << 20
    try:
        with pytest.raises(StorageError, match="shrank"):
            # Claim more bytes than the file has: the last part fails mid-upload.
            await upload_multipart(storage, str(src), "big.bin", 11 << 20)
        with pytest.raises(ObjectNotFoundError):
            await storage.head("big.bin")
        pending = await storage.request("GET", None, what=storage.url, query={"uploads": ""})
        assert b"<UploadId>" not in pending.body  # aborted, nothing left behind
    finally:
        await storage.close()


@pytest.mark.timeout(60)
def test_objstore_dies_with_a_killed_parent(tmp_path):
    """A parent killed by SIGKILL runs no atexit: the server must still go."""
    import signal as _signal
    import subprocess
    import sys
    import time

    code = (
        "import time\n"
        "from asynccache.testing import ObjectStore\n"
        "s = ObjectStore(); s.start(); print(s.pid, *s.ports.values(), flush=True)\n"
        "time.sleep(120)\n"
    )
    # The killed parent cannot remove the server's directory: let it land in a directory
    # of this test (short: the server's unix sockets live in it).
    own = Path(tempfile.mkdtemp())
    env = {**os.environ, "TMPDIR": str(own)}
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pid, *ports = map(int, parent.stdout.readline().split())
        parent.send_signal(_signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"weed {pid} outlived its killed parent")
        # What survived: the server's directory (nothing else of ours) and weed's gRPC
        # sockets in /tmp, which remove_sockets clears by port.
        left = sorted(own.iterdir())
        assert [p.name[:20] for p in left] == ["asynccache-objstore-"], left
        assert (left[0] / "data").is_dir()
        socks = [p for port in ports for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]
        assert socks, "a killed weed leaves its sockets"
        remove_sockets(ports)
        assert not any(p.exists() for p in socks)
    finally:
        parent.kill()
        parent.stdout.close()
        shutil.rmtree(own, ignore_errors=True)
