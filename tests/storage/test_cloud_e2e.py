"""End to end on each cloud emulator: upload a written dataset, prefetch it, stream it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from asynccache.config import Settings
from asynccache.read.prefetch import prefetch
from asynccache.torch.streaming import StreamingDataset
from asynccache.write.upload import upload
from tests.remote_data import write_dataset

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

N = 41


def _root(request: pytest.FixtureRequest, kind: str) -> tuple[str, dict[str, Any]]:
    if kind == "gs":
        emulator = request.getfixturevalue("gcs_emulator")
        return f"gs://{request.getfixturevalue('gcs_bucket')}/ds", emulator.storage_options
    azurite = request.getfixturevalue("azurite")
    return f"az://{request.getfixturevalue('az_container')}/ds", azurite.storage_options


@pytest.mark.parametrize("kind", ["gs", "az"])
def test_upload_prefetch_stream(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> None:
    url, options = _root(request, kind)
    src = write_dataset(tmp_path / "src", N, chunk_size=6)
    quiet = Settings.from_env(progress=False, max_concurrency=4, part_bytes=1 << 10)
    summary = upload(src, url, options, settings=quiet)
    assert summary.objects >= 8  # seven chunks and index.json at least
    again = upload(src, url, options, settings=quiet)
    assert again.skipped >= 7  # chunks already there with the same checksum

    stats = prefetch(url, tmp_path / "warm", options, settings=quiet)
    assert stats.chunks_fetched == 7
    assert prefetch(url, tmp_path / "warm", options, settings=quiet).chunks_fetched == 0

    ds = StreamingDataset(url, cache_dir=tmp_path / "cold", storage_options=options, settings=quiet)
    try:
        assert ds[40]["name"] == "item-40"
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        got = sorted(int(item["name"].split("-")[1]) for item in loader)
        assert got == list(range(N))
    finally:
        ds.close()
