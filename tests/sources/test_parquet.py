"""Parquet read without conversion: a local directory and a real S3 server, real files
written with pyarrow; order, shuffle, split, resume, budget, columns, and the errors a bad
input gets (each naming the file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from asynccache.errors import (
    BadMagicError,
    ConfigError,
    CorruptFooterError,
    DatasetRewrittenError,
    ObjectNotFoundError,
    SchemaMismatchError,
)
from asynccache.testing import ObjectStore
from asynccache.testing.resume import assert_resumes_exactly, comparable
from asynccache.torch.dataloader import CacheDataLoader
from asynccache.torch.streaming import StreamingDataset
from tests.sources.data import check_row, delete, put_dir, put_file, table, write_parquet

SIZES = [130, 95, 150, 60]  # 435 rows, 13 row groups of at most 40
TOTAL = sum(SIZES)


@pytest.fixture
def local(tmp_path: Path) -> Path:
    write_parquet(tmp_path / "table", SIZES)
    return tmp_path / "table"


def test_local_prefix_reads_every_row_in_order(local: Path, tmp_path: Path) -> None:
    ds = StreamingDataset(local, cache_dir=tmp_path / "c")
    assert ds.num_items == TOTAL and ds.index.num_chunks == 13
    ids = [check_row(row) for row in ds]
    assert ids == list(range(TOTAL))
    assert check_row(ds[321]) == 321
    # the footers were cached beside the data and in the node's cache
    assert list(local.glob("_asynccache-footers-*.bin"))
    assert list((tmp_path / "c" / ".sources").glob("*.footers"))


def test_shuffle_and_split_cover_every_row_once(
    local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = StreamingDataset(local, cache_dir=tmp_path / "c", shuffle=True, seed=5, drop_last=True)
        loader = CacheDataLoader(ds, batch_size=8, num_workers=2)
        part = [int(i) for b in loader for i in b["id"].tolist()]
        assert len(part) == TOTAL // 2
        seen += part
    assert len(set(seen)) == len(seen) == TOTAL - TOTAL % 2
    assert seen[: TOTAL // 2] != sorted(seen[: TOTAL // 2])  # shuffled


def test_columns_select_and_batches_are_columns(local: Path, tmp_path: Path) -> None:
    ds = StreamingDataset(local, cache_dir=tmp_path / "c", columns=["id", "text", "vec"])
    assert set(ds[3]) == {"id", "text", "vec"}
    loader = CacheDataLoader(ds, batch_size=50, num_workers=0)
    batches = list(loader)
    assert ds.batch_stats()["assembled"] == len(batches)
    first = batches[0]
    assert first["id"].tolist() == list(range(50)) and first["text"][2] == "row 2"
    assert tuple(first["vec"].shape) == (50, 4)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, TOTAL - 1), min_size=1, max_size=60))
def test_column_batch_equals_collated_items(
    tmp_path_factory: pytest.TempPathFactory, keys: list[int]
) -> None:
    root = tmp_path_factory.getbasetemp() / "prop"
    if not root.exists():
        write_parquet(root, SIZES)
    ds = _prop_ds(root)
    arr = np.asarray(keys, dtype=np.int64)
    cols = ds.unit_reader.columns_batch(arr)
    items = [ds[k] for k in keys]
    want = default_collate(items) if "text" in items[0] else None
    from torch.utils.data import default_convert

    assert comparable(default_convert(cols)) == comparable(want)


_PROP: dict[str, StreamingDataset] = {}


def _prop_ds(root: Path) -> StreamingDataset:
    if str(root) not in _PROP:
        _PROP[str(root)] = StreamingDataset(
            root, cache_dir=root.parent / "propc", columns=["id", "x", "label", "text", "vec"]
        )
    return _PROP[str(root)]


def test_resume_exactly(local: Path, tmp_path: Path) -> None:
    def make() -> CacheDataLoader:
        ds = StreamingDataset(local, cache_dir=tmp_path / "c", shuffle=True, seed=1, columns=["id"])
        return CacheDataLoader(ds, batch_size=16, num_workers=2)

    assert_resumes_exactly(make, [0, 3, 17, 27])


# -- errors, each naming the file ----------------------------------------------------
def test_corrupt_footer_names_the_file(local: Path, tmp_path: Path) -> None:
    bad = local / "part-1.parquet"
    data = bytearray(bad.read_bytes())
    data[-8:-4] = (len(data) * 2).to_bytes(4, "little")  # a footer longer than the file
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptFooterError, match="part-1.parquet"):
        StreamingDataset(local, cache_dir=tmp_path / "c")
    data[-4:] = b"XXXX"
    bad.write_bytes(bytes(data))
    with pytest.raises(BadMagicError, match="part-1.parquet"):
        StreamingDataset(local, cache_dir=tmp_path / "c")
    n = int.from_bytes(data[-8:-4], "little")
    good = (local / "part-0.parquet").read_bytes()
    flen = int.from_bytes(good[-8:-4], "little")
    garbled = good[: -flen - 8] + b"\x07" * flen + good[-8:]  # thrift that does not parse
    bad.write_bytes(garbled)
    del n
    with pytest.raises(CorruptFooterError, match="part-1.parquet"):
        StreamingDataset(local, cache_dir=tmp_path / "c")


def test_schema_change_names_both_files(local: Path, tmp_path: Path) -> None:
    t = table(10_000, 20).set_column(2, "label", pa.array(np.zeros(20, dtype=np.float64)))
    pq.write_table(t, local / "sub" / "part-9.parquet")
    with pytest.raises(SchemaMismatchError, match=r"part-9.parquet.*part-0.parquet.*label"):
        StreamingDataset(local, cache_dir=tmp_path / "c")
    # not read, not compared
    ds = StreamingDataset(local, cache_dir=tmp_path / "c", columns=["id", "text"])
    assert ds.num_items == TOTAL + 20


def test_glob_matching_nothing_and_unknown_column(tmp_path: Path, local: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty: no file matches '\*\*/\*.parquet'"):
        StreamingDataset(tmp_path / "empty", cache_dir=tmp_path / "c2", columns=["id"])
    with pytest.raises(ObjectNotFoundError, match="index.json"):  # neither kind: the index's
        StreamingDataset(tmp_path / "empty", cache_dir=tmp_path / "c2")
    with pytest.raises(ConfigError, match="no file matches 'nope/\\*.parquet'"):
        StreamingDataset(local, cache_dir=tmp_path / "c", files="nope/*.parquet")
    with pytest.raises(ConfigError, match="no column 'nope'"):
        StreamingDataset(local, cache_dir=tmp_path / "c", columns=["id", "nope"])


def test_local_file_changed_or_missing_after_listing(local: Path, tmp_path: Path) -> None:
    ds = StreamingDataset(local, cache_dir=tmp_path / "c", columns=["id"])
    assert check_row(ds[0], ["id"]) == 0
    pq.write_table(table(0, 95), local / "part-1.parquet", row_group_size=40)  # rewritten
    os.utime(local / "part-1.parquet", ns=(1, 1))
    with pytest.raises(DatasetRewrittenError, match="part-1.parquet"):
        ds[140]
    (local / "sub" / "part-3.parquet").unlink()
    with pytest.raises(ObjectNotFoundError, match="part-3.parquet"):
        ds[TOTAL - 1]


def test_pyarrow_missing_says_how_to_install(local: Path, tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from asynccache.torch.streaming import StreamingDataset\n"
        "from asynccache.errors import ConfigError\n"
        "try:\n"
        f"    StreamingDataset({str(local)!r}, cache_dir={str(tmp_path / 'c')!r}, columns=['id'])\n"
        "except ConfigError as e:\n"
        "    print('CONFIG', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "CONFIG" in out.stdout and "pip install 'asynccache[parquet]'" in out.stdout, out


# -- a real S3 server ------------------------------------------------------------------
@pytest.mark.slow
def test_s3_columns_fetch_only_their_pages_and_budget(
    objstore: ObjectStore, bucket: str, local: Path, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/table"
    put_dir(local, url, objstore.storage_options)
    full = sum(p.stat().st_size for p in local.rglob("*.parquet"))
    ds = StreamingDataset(
        url,
        cache_dir=tmp_path / "c",
        storage_options=objstore.storage_options,
        columns=["id", "label"],
        shuffle=True,
        seed=2,
    )
    rows = sorted(check_row(r, ["id", "label"]) for r in ds)
    assert rows == list(range(TOTAL))
    got = ds.download_stats()
    assert 0 < got["bytes"] < full / 4  # the blob, text, vec and x pages stayed there
    # the footers went beside the data; a fresh node reads them from there
    listed = subprocess_free_list(url, objstore)
    assert any(k.startswith("_asynccache-footers-") for k in listed)
    # a budget of a few row groups: the epoch still reads every row once, within it
    opts = objstore.storage_options
    probe = StreamingDataset(url, cache_dir=tmp_path / "c3", storage_options=opts)
    budget = 5 * int(probe.index.bytes_per_chunk.max())
    assert budget < probe.index.total_bytes / 2
    small = StreamingDataset(
        url, cache_dir=tmp_path / "c3", storage_options=opts, max_cache_bytes=budget
    )
    loader = CacheDataLoader(small, batch_size=20, num_workers=2)
    ids = sorted(int(i) for b in loader for i in b["id"].tolist())
    assert ids == list(range(TOTAL))
    used, limit = small.cache_usage()
    assert limit == budget and used <= budget


def subprocess_free_list(url: str, objstore: ObjectStore) -> list[str]:
    from asynccache.bridge import get_loop_thread
    from asynccache.config import Settings
    from asynccache.storage import open_storage

    s = open_storage(url, Settings.from_env(), objstore.storage_options)
    lt = get_loop_thread()
    try:
        return [o.key for o in lt.call(s.list(""), 30)]
    finally:
        lt.call(s.close(), 10)


@pytest.mark.slow
def test_s3_file_rewritten_under_a_running_job_fails_naming_it(
    objstore: ObjectStore, bucket: str, local: Path, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/table"
    put_dir(local, url, objstore.storage_options)
    ds = StreamingDataset(url, cache_dir=tmp_path / "c", storage_options=objstore.storage_options)
    assert check_row(ds[0]) == 0  # part-0 read
    other = tmp_path / "other.parquet"
    pq.write_table(table(5000, 95), other, row_group_size=40)  # another version of part-1
    put_file(other, url, "part-1.parquet", objstore.storage_options)
    with pytest.raises(DatasetRewrittenError, match=r"part-1.parquet.*changed"):
        ds[140]
    delete(url, "sub/part-3.parquet", objstore.storage_options)
    with pytest.raises(ObjectNotFoundError, match="part-3.parquet"):
        ds[TOTAL - 1]
    ds.close()
    # opened again, the new version is read
    again = StreamingDataset(
        url, cache_dir=tmp_path / "c", storage_options=objstore.storage_options
    )
    assert again.num_items == TOTAL - 60
    assert int(again[140]["id"]) == 5000 + 10


def test_another_tools_index_beside_the_files_is_read_as_parquet(
    local: Path, tmp_path: Path
) -> None:
    """litdata's index_parquet_dataset leaves an index.json beside the files."""
    (local / "index.json").write_text('{"chunks": [], "config": {"item_loader": "ParquetLoader"}}')
    ds = StreamingDataset(local, cache_dir=tmp_path / "c")
    assert ds.num_items == TOTAL and check_row(ds[5]) == 5
