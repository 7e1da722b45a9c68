"""hf:// against a loopback Hub and CDN: resolution, token confinement, revision pinning."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from asynccache.config import Settings
from asynccache.errors import AuthError, ConfigError, ObjectNotFoundError, StorageError
from asynccache.read.prefetch import prefetch
from asynccache.storage import open_storage
from asynccache.testing.hubserver import HubServer
from asynccache.torch.streaming import StreamingDataset
from tests.remote_data import write_dataset

pytestmark = pytest.mark.timeout(60)

BIG = bytes(range(256)) * 64  # 16 KiB: an LFS file, served by the CDN
SMALL = b'{"small": true}\n'  # a git file, served by the Hub itself
TOKEN = "hf_" + "t" * 30


def _files(tag: bytes = b"") -> dict[str, bytes]:
    return {"data/big.bin": tag + BIG, "data/meta.json": SMALL, "README.md": b"# card\n"}


@pytest.mark.parametrize(
    "url",
    [
        "hf://datasets",
        "hf://datasets/org",
        "hf://models/org/name",
        "hf://datasets/o/n@/x",
        "hf://datasets/o/n/a//b",
    ],
)
def test_malformed_hf_urls(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_storage(url, Settings())
    assert url in str(err.value)


def test_without_the_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.delitem(sys.modules, "asynccache.storage.hf", raising=False)
    with pytest.raises(ConfigError, match=r"pip install 'asynccache\[hf\]'"):
        open_storage("hf://datasets/org/name", Settings())


def test_endpoint_and_token_from_the_env_mapping() -> None:
    env = Settings.aws_env(
        {"HF_TOKEN": TOKEN, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": "/x"}
    )
    assert env == {"HF_TOKEN": TOKEN, "HF_ENDPOINT": "http://127.0.0.1:9"}
    storage = open_storage("hf://datasets/org/name@v1.0/sub/", Settings(), aws_env=env)
    assert storage.url == "hf://datasets/org/name@v1.0/sub"
    assert storage.endpoint == "http://127.0.0.1:9"  # type: ignore[attr-defined]
    assert storage.revision == "v1.0"  # type: ignore[attr-defined]
    assert TOKEN not in repr(storage) and "HF_TOKEN" in repr(storage)
    pr = open_storage("hf://datasets/org/name@refs%2Fpr%2F3", Settings(), aws_env={})
    assert pr.revision == "refs/pr/3"  # type: ignore[attr-defined]


async def test_reads_resolve_through_the_cdn_with_ranges(hub: HubServer) -> None:
    sha = hub.commit("org/pub", _files())
    storage = open_storage("hf://datasets/org/pub/data", Settings(), {"endpoint_url": hub.url})
    try:
        big = await storage.head("big.bin")
        assert (big.size, big.etag) == (len(BIG), hub_etag(BIG))
        assert storage.commit == sha  # type: ignore[attr-defined]
        assert (await storage.head("meta.json")).size == len(SMALL)
        parts = [await storage.read("big.bin", a, a + 4096) for a in range(0, len(BIG), 4096)]
        assert b"".join(parts) == BIG
        assert await storage.read("meta.json", 2, 7) == SMALL[2:7]
        assert [o.key for o in await storage.list()] == ["big.bin", "meta.json"]
        with pytest.raises(ObjectNotFoundError, match=r"hf://datasets/org/pub/data/nope\.bin"):
            await storage.head("nope.bin")
        with pytest.raises(StorageError, match="read-only"):
            await storage.delete("big.bin")
    finally:
        await storage.close()
    ranged = [r for r in hub.cdn_requests if r.method == "GET"]
    assert [r.headers["Range"] for r in ranged] == [
        f"bytes={a}-{a + 4095}" for a in range(0, len(BIG), 4096)
    ]
    hub_gets = [r for r in hub.hub_requests if r.method == "GET" and "big.bin" in r.path]
    assert len(hub_gets) == 1  # the CDN location was reused for the other ranges
    assert all(f"/resolve/{sha}/" in r.path for r in hub_gets)  # pinned after the first answer


async def test_redirect_without_linked_size_asks_the_far_host_without_the_token(
    hub: HubServer,
) -> None:
    hub.linked_headers = False
    hub.commit("org/mirror", _files())
    storage = open_storage(
        "hf://datasets/org/mirror", Settings(), {"endpoint_url": hub.url, "token": TOKEN}
    )
    try:
        assert (await storage.head("data/big.bin")).size == len(BIG)
    finally:
        await storage.close()
    heads = [r for r in hub.cdn_requests if r.method == "HEAD"]
    assert len(heads) == 1 and "Authorization" not in heads[0].headers


async def test_token_goes_to_the_hub_only_and_never_leaks(
    hub: HubServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    hub.token = TOKEN
    hub.commit("org/private", _files(), private=True)
    url = "hf://datasets/org/private"
    storage = open_storage(url, Settings(), aws_env={"HF_TOKEN": TOKEN, "HF_ENDPOINT": hub.url})
    try:
        assert await storage.read("data/big.bin", 100, 200) == BIG[100:200]
        assert await storage.read("data/meta.json") == SMALL
        assert len(await storage.list("data/")) == 2
    finally:
        await storage.close()
    assert hub.hub_requests and all(
        r.headers.get("Authorization") == f"Bearer {TOKEN}" for r in hub.hub_requests
    )
    assert hub.cdn_requests and all("Authorization" not in r.headers for r in hub.cdn_requests)
    assert TOKEN not in caplog.text

    anonymous = open_storage(url, Settings(), {"endpoint_url": hub.url, "token": False})
    wrong = open_storage(
        url, Settings(), {"endpoint_url": hub.url, "token": "hf_wrong_" + "w" * 20}
    )
    try:
        with pytest.raises(AuthError) as err:
            await anonymous.read("data/big.bin")
        assert f"{url}/data/big.bin" in str(err.value) and "HF_TOKEN" in str(err.value)
        with pytest.raises(AuthError) as err2:
            await wrong.head("data/meta.json")
        assert "storage_options token" in str(err2.value) and "hf_wrong_" not in str(err2.value)
    finally:
        await anonymous.close()
        await wrong.close()


async def test_revision_is_pinned_while_the_branch_moves(hub: HubServer) -> None:
    first = hub.commit("org/moving", _files(b"v1"))
    reader = open_storage("hf://datasets/org/moving", Settings(), {"endpoint_url": hub.url})
    try:
        assert (await reader.read("data/big.bin", 0, 2)) == b"v1"
        second = hub.commit("org/moving", _files(b"v2"))
        assert (await reader.read("data/big.bin", 0, 2)) == b"v1"  # same commit throughout
        assert (await reader.head("data/big.bin")).etag == hub_etag(b"v1" + BIG)
        assert reader.commit == first  # type: ignore[attr-defined]
        pinned = reader.pinned_url  # type: ignore[attr-defined]
        assert pinned == f"hf://datasets/org/moving@{first}"
    finally:
        await reader.close()
    again = open_storage(pinned, Settings(), {"endpoint_url": hub.url})
    try:  # another process opening the pinned URL reads the same commit
        assert await again.read("data/big.bin", 0, 2) == b"v1"
    finally:
        await again.close()
    for url, expected in (
        ("hf://datasets/org/moving", b"v2"),
        (f"hf://datasets/org/moving@{first}", b"v1"),
        (f"hf://datasets/org/moving@{second}", b"v2"),
    ):
        storage = open_storage(url, Settings(), {"endpoint_url": hub.url})
        try:
            assert await storage.read("data/big.bin", 0, 2) == expected
        finally:
            await storage.close()
    missing = open_storage("hf://datasets/org/moving@nope", Settings(), {"endpoint_url": hub.url})
    try:
        with pytest.raises(ObjectNotFoundError, match="RevisionNotFound"):
            await missing.head("README.md")
    finally:
        await missing.close()


def hub_etag(data: bytes) -> str:
    import hashlib

    return f'"{hashlib.sha256(data).hexdigest()}"'


@pytest.mark.slow
def test_streaming_dataset_and_prefetch_from_the_hub(hub: HubServer, tmp_path: Path) -> None:
    hub.token = TOKEN
    src = write_dataset(tmp_path / "src", 41, chunk_size=6, pad=2048)
    hub.commit(
        "org/ds", {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}, private=True
    )
    url = "hf://datasets/org/ds"
    options = {"endpoint_url": hub.url, "token": TOKEN}
    quiet = Settings.from_env(progress=False, max_concurrency=4, part_bytes=4 << 10)
    stats = prefetch(url, tmp_path / "warm", options, settings=quiet)
    assert stats.chunks_fetched == 7
    ds = StreamingDataset(url, cache_dir=tmp_path / "cold", storage_options=options, settings=quiet)
    try:
        got = sorted(
            int(item["name"].split("-")[1])
            for item in DataLoader(ds, batch_size=None, num_workers=2)
        )
        assert got == list(range(41))
    finally:
        ds.close()
    assert all("Authorization" not in r.headers for r in hub.cdn_requests)
    ranged = [r for r in hub.cdn_requests if r.headers.get("Range")]
    assert len(ranged) > 2 * 7  # chunks came in several ranged parts each
