"""A Hub dataset of Parquet files (hf://datasets/org/name), against the loopback Hub and its
CDN: read at one pinned commit, only the selected columns fetched, resumed exactly."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from asynccache.testing.hubserver import HubServer
from asynccache.testing.resume import assert_resumes_exactly
from asynccache.torch.dataloader import CacheDataLoader
from asynccache.torch.streaming import StreamingDataset
from tests.sources.data import check_row, table


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


def _parquet(first: int, n: int) -> bytes:
    out = io.BytesIO()
    pq.write_table(table(first, n), out, row_group_size=30)
    return out.getvalue()


def _repo(first_rows: int = 0) -> dict[str, bytes]:
    return {
        "README.md": b"# a dataset\n",
        "data/train-00000-of-00002.parquet": _parquet(first_rows, 70),
        "data/train-00001-of-00002.parquet": _parquet(first_rows + 70, 50),
    }


@pytest.mark.slow
def test_hub_dataset_reads_at_a_pinned_commit(hub: HubServer, tmp_path: Path) -> None:
    first = hub.commit("org/tab", _repo())
    opts = {"endpoint_url": hub.url}
    ds = StreamingDataset(
        "hf://datasets/org/tab",
        cache_dir=tmp_path / "c",
        storage_options=opts,
        columns=["id", "text"],
        shuffle=True,
        seed=4,
    )
    assert first in ds.source._open_url  # every process opens this commit
    hub.commit("org/tab", _repo(first_rows=1000))  # the branch moves on
    rows = sorted(check_row(r, ["id", "text"]) for r in ds)
    assert rows == list(range(120))  # all from the commit opened
    assert ds.download_stats()["bytes"] < sum(len(v) for v in _repo().values()) / 3


@pytest.mark.slow
def test_hub_dataset_resumes_exactly(hub: HubServer, tmp_path: Path) -> None:
    hub.commit("org/tab", _repo())
    opts = {"endpoint_url": hub.url}

    def make() -> CacheDataLoader:
        ds = StreamingDataset(
            "hf://datasets/org/tab",
            cache_dir=tmp_path / "c",
            storage_options=opts,
            columns=["id", "label"],
            shuffle=True,
            seed=1,
        )
        return CacheDataLoader(ds, batch_size=8, num_workers=2)

    assert_resumes_exactly(make, [0, 4, 14])
