"""The remote index.json: damage in transit is retried, then a clear error (issue 9, D)."""

from __future__ import annotations

import pytest

from asynccache.config import Settings
from asynccache.errors import CorruptIndexError
from asynccache.read.source import DatasetSource
from asynccache.testing.faults import Fault, FaultProxy
from tests.remote_data import write_dataset

pytestmark = pytest.mark.timeout(60)

RETRIES = 3


@pytest.fixture
def served(tmp_path, http_origin):
    src = write_dataset(tmp_path / "src", 10, chunk_size=4)
    text = (src / "index.json").read_bytes()
    # A hex digit of a chunk checksum, XORed with 1, is still valid JSON (and a valid
    # index): only the embedded index checksum can tell the damage.
    at = text.index(b'"xxh3_64:') + len(b'"xxh3_64:')
    return http_origin(src), at


def _settings(tmp_path) -> Settings:
    return Settings(
        cache_dir=str(tmp_path / "cc"), retries=RETRIES, backoff_base_s=0.01, backoff_max_s=0.05
    )


def test_index_damaged_once_is_fetched_again(served, tmp_path) -> None:
    server, at = served
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", path="index.json", flip_at=at, flip_xor=1))
        src = DatasetSource(proxy.url, settings=_settings(tmp_path))
        assert proxy.fired("flip") == 1
        assert proxy.count("GET", "index.json") == 2
        assert src.index.total_items == 10
        src.close()


def test_index_damaged_every_time_is_a_clear_error(served, tmp_path) -> None:
    server, at = served
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("flip", times=100, path="index.json", flip_at=at, flip_xor=1))
        with pytest.raises(CorruptIndexError) as info:
            DatasetSource(proxy.url, settings=_settings(tmp_path))
        message = str(info.value)
        assert f"{proxy.url}/index.json" in message and f"{RETRIES + 1} attempts" in message
        assert proxy.fired("flip") == RETRIES + 1 == proxy.count("GET", "index.json")
