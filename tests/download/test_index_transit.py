"""A remote index.json damaged on the way is fetched again, even when the damage breaks
its JSON; only an index refused every time (or one its own checksum vouches for) is an
error, naming the URL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynccache.cache.indexfile import load_fetched
from asynccache.config import Settings
from asynccache.errors import BadIndexError, CorruptIndexError
from asynccache.format.index import INDEX_CHECKSUM_FIELD, seal, verify_sealed_bytes
from asynccache.read.source import DatasetSource
from asynccache.testing.faults import Fault, FaultProxy
from tests.remote_data import write_dataset

pytestmark = pytest.mark.timeout(60)

RETRIES = 3


def _settings(tmp_path: Path) -> Settings:
    return Settings(
        cache_dir=str(tmp_path / "cc"),
        retries=RETRIES,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        progress=False,
    )


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "src", 10, chunk_size=4)


def _where(text: bytes) -> dict[str, int]:
    """Byte offsets whose flip breaks the JSON: the opening brace, a colon, the quote
    that opens the checksum member's name, and the checksum line's closing brace."""
    return {
        "opening brace": 0,
        "a colon": text.index(b":"),
        "the checksum member's name": text.index(f'"{INDEX_CHECKSUM_FIELD}"'.encode()),
        "the last brace": len(text) - 2,
    }


@pytest.mark.parametrize("spot", ["opening brace", "a colon", "the checksum member's name"])
def test_a_flip_that_breaks_the_json_is_fetched_again(dataset, tmp_path, http_origin, spot):
    text = (dataset / "index.json").read_bytes()
    at = _where(text)[spot]
    damaged = bytearray(text)
    damaged[at] ^= 0xFF
    with pytest.raises(ValueError):  # the damage breaks the JSON
        json.loads(bytes(damaged))
    server = http_origin(dataset)
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", path="index.json", flip_at=at, flip_xor=0xFF))
        with DatasetSource(proxy.url, settings=_settings(tmp_path)) as src:
            assert src.index.total_items == 10
        assert proxy.fired("flip") == 1
        assert proxy.count("GET", "index.json") == 2


def test_the_last_brace_flipped_is_fetched_again(dataset, tmp_path, http_origin) -> None:
    """The checksum line itself damaged: the bytes can't be vouched for, the JSON breaks."""
    text = (dataset / "index.json").read_bytes()
    at = _where(text)["the last brace"]
    assert text[at : at + 1] == b"}"
    server = http_origin(dataset)
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", path="index.json", flip_at=at, flip_xor=0x01))
        with DatasetSource(proxy.url, settings=_settings(tmp_path)) as src:
            assert src.index.total_items == 10
        assert proxy.fired("flip") == 1
        assert proxy.count("GET", "index.json") == 2


def test_broken_every_time_is_a_corrupt_index_naming_the_url(dataset, tmp_path, http_origin):
    server = http_origin(dataset)
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", times=100, path="index.json", flip_at=0, flip_xor=0xFF))
        with pytest.raises(CorruptIndexError) as info:
            DatasetSource(proxy.url, settings=_settings(tmp_path))
        message = str(info.value)
        assert f"{proxy.url}/index.json" in message and f"{RETRIES + 1} attempts" in message
        assert proxy.fired("flip") == RETRIES + 1 == proxy.count("GET", "index.json")


def test_unsealed_and_not_json_every_time_is_a_bad_index(tmp_path, http_origin) -> None:
    """Without a checksum nothing tells damage from a bad file: fetched again, and once
    every attempt gave the same refusal, that refusal is the error."""
    root = tmp_path / "bad"
    root.mkdir()
    (root / "index.json").write_bytes(b'{"format": "asynccache-index", "version": 1,')
    server = http_origin(root)
    with FaultProxy(server.url) as proxy:
        with pytest.raises(BadIndexError) as info:
            DatasetSource(proxy.url, settings=_settings(tmp_path))
        assert not isinstance(info.value, CorruptIndexError)
        message = str(info.value)
        assert f"{proxy.url}/index.json" in message and f"{RETRIES + 1} attempts" in message
        assert "not valid JSON" in message
        assert proxy.count("GET", "index.json") == RETRIES + 1


def test_an_index_its_checksum_vouches_for_is_refused_at_once(tmp_path, http_origin) -> None:
    """The writer's own bytes (sealed, intact) with an error: fetching again can't help."""
    body = json.dumps({"format": "asynccache-index", "version": 99}, indent=1, sort_keys=True)
    root = tmp_path / "v99"
    root.mkdir()
    (root / "index.json").write_text(seal(body + "\n"))
    server = http_origin(root)
    with FaultProxy(server.url) as proxy:
        with pytest.raises(BadIndexError, match="version 99") as info:
            DatasetSource(proxy.url, settings=_settings(tmp_path))
        assert f"{proxy.url}/index.json" in str(info.value)
        assert proxy.count("GET", "index.json") == 1


def test_raw_bytes_are_judged_before_the_parse(dataset) -> None:
    text = (dataset / "index.json").read_bytes()
    assert verify_sealed_bytes(text, "x") is True
    assert verify_sealed_bytes(text.replace(b'"index_checksum"', b'"index_checksuM"'), "x") is False
    damaged = bytearray(text)
    damaged[0] ^= 0xFF
    with pytest.raises(CorruptIndexError, match="hash to"):
        verify_sealed_bytes(bytes(damaged), "x")
    with pytest.raises(CorruptIndexError, match="hash to"):
        load_fetched(bytes(damaged), "x")  # damage, though the JSON is what broke
    unsealed = b"{not json"
    with pytest.raises(CorruptIndexError) as info:
        load_fetched(unsealed, "x")  # no checksum to vouch: maybe damage, fetch again
    assert "not valid JSON" in str(info.value)
