"""Folders of files read without conversion: one item per file, a user function in the
worker, labels from the path or a side file, a cached listing refreshed on request, small
files packed and fetched many at a time under the budget; a local folder and the real S3
server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from asynccache.config import Settings
from asynccache.errors import ConfigError, ObjectNotFoundError
from asynccache.format.images import DecodeImages
from asynccache.testing import ObjectStore
from asynccache.testing.photos import jpeg_bytes
from asynccache.testing.resume import assert_resumes_exactly
from asynccache.torch.dataloader import CacheDataLoader
from asynccache.torch.streaming import StreamingDataset
from tests.sources.data import delete, put_dir

CLASSES = ["cat", "dog", "eel"]
PER_CLASS = 20


def make_folder(root: Path) -> list[str]:
    """``train/<class>/<n>.jpg`` photos, a ``notes.txt`` the glob leaves out, and a
    ``labels.json`` side file; returns the keys in listing order."""
    keys = []
    for c, name in enumerate(CLASSES):
        d = root / "train" / name
        d.mkdir(parents=True, exist_ok=True)
        for n in range(PER_CLASS):
            (d / f"{n:03d}.jpg").write_bytes(jpeg_bytes(c * 100 + n, 40 + n, 30))
            keys.append(f"train/{name}/{n:03d}.jpg")
    (root / "notes.txt").write_text("not an image")
    labels = {k: 10 + CLASSES.index(k.split("/")[1]) for k in keys}
    (root / "labels.json").write_text(json.dumps(labels))
    return sorted(keys)


def shape_of(key: str, data: bytes, label: int) -> tuple[str, int, int]:
    """A user function: (key, bytes, label) -> item, run in the worker."""
    img = DecodeImages(to="numpy")({"x": data})["x"]
    return key, int(img.shape[1]), label


def test_local_folder_items_labels_and_listing_cache(tmp_path: Path) -> None:
    keys = make_folder(tmp_path / "f")
    ds = StreamingDataset(
        tmp_path / "f", cache_dir=tmp_path / "c", files="**/*.jpg", labels="dir", shuffle=True
    )
    assert ds.num_items == len(keys)
    items = list(ds)
    assert sorted(i["key"] for i in items) == keys
    for it in items:
        assert it["label"] == CLASSES.index(it["key"].split("/")[1])
        assert it["data"][:3] == b"\xff\xd8\xff"
    # the listing is cached: a new file is seen only on refresh
    (tmp_path / "f" / "train" / "cat" / "999.jpg").write_bytes(jpeg_bytes(9, 8, 8))
    same = StreamingDataset(tmp_path / "f", cache_dir=tmp_path / "c", files="**/*.jpg")
    assert same.num_items == len(keys)
    fresh = StreamingDataset(
        tmp_path / "f", cache_dir=tmp_path / "c", files="**/*.jpg", refresh=True
    )
    assert fresh.num_items == len(keys) + 1


def test_user_function_with_side_file_labels_in_workers(tmp_path: Path) -> None:
    keys = make_folder(tmp_path / "f")
    ds = StreamingDataset(
        tmp_path / "f",
        cache_dir=tmp_path / "c",
        files="train/*/*.jpg",
        labels="labels.json",
        decode=shape_of,
    )
    loader = CacheDataLoader(ds, batch_size=7, num_workers=2)
    got = [row for b in loader for row in zip(b[0], b[1].tolist(), b[2].tolist(), strict=True)]
    assert sorted(k for k, _, _ in got) == keys
    for key, width, label in got:
        n = int(key.rsplit("/", 1)[1][:3])
        assert width == 40 + n and label == 10 + CLASSES.index(key.split("/")[1])


def test_resume_exactly(tmp_path: Path) -> None:
    make_folder(tmp_path / "f")

    def make() -> CacheDataLoader:
        ds = StreamingDataset(
            tmp_path / "f",
            cache_dir=tmp_path / "c",
            files="**/*.jpg",
            labels="dir",
            shuffle=True,
            seed=2,
            decode=shape_of,
        )
        return CacheDataLoader(ds, batch_size=5, num_workers=2)

    assert_resumes_exactly(make, [0, 3, 11])


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    make_folder(tmp_path / "f")
    with pytest.raises(ConfigError, match=r"no file matches files='\*\*/\*.png'"):
        StreamingDataset(tmp_path / "f", cache_dir=tmp_path / "c", files="**/*.png")
    (tmp_path / "f" / "labels.csv").write_text("train/cat/000.jpg,1\n")
    with pytest.raises(ConfigError, match=r"labels.csv: no label for train/cat/001.jpg"):
        StreamingDataset(
            tmp_path / "f", cache_dir=tmp_path / "c", files="**/*.jpg", labels="labels.csv"
        )
    with pytest.raises(ObjectNotFoundError, match="nope.json"):
        StreamingDataset(
            tmp_path / "f", cache_dir=tmp_path / "c", files="**/*.jpg", labels="nope.json"
        )
    ds = StreamingDataset(tmp_path / "f", cache_dir=tmp_path / "c", files="**/*.jpg")
    (tmp_path / "f" / "train" / "dog" / "005.jpg").unlink()  # gone after listing
    with pytest.raises(ObjectNotFoundError, match="dog/005.jpg"):
        list(ds)


@pytest.mark.slow
def test_s3_folder_packed_units_under_a_budget(
    objstore: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    keys = make_folder(tmp_path / "f")
    url = f"s3://{bucket}/images"
    put_dir(tmp_path / "f", url, objstore.storage_options)
    opts = objstore.storage_options
    from asynccache.read.files import FilesSource

    src = FilesSource(
        url, files="**/*.jpg", cache_dir=tmp_path / "c", storage_options=opts, pack_bytes=8192
    )
    sizes = src.index.bytes_per_chunk
    assert src.index.num_chunks > 5 and int(src.index.items_per_chunk.max()) > 1  # packed
    budget = 5 * int(sizes.max())
    assert budget < int(sizes.sum()) * 0.6  # not all of it at once
    src.close()
    ds = StreamingDataset(
        url,
        cache_dir=tmp_path / "c",
        files="**/*.jpg",
        labels="labels.json",
        storage_options=opts,
        settings=Settings.from_env(part_bytes=8192, max_cache_bytes=budget),
    )
    assert ds.index.num_chunks == src.index.num_chunks  # units of about one part
    loader = CacheDataLoader(ds, batch_size=6, num_workers=2, collate_fn=lambda b: b)
    got = [it for b in loader for it in b]
    assert sorted(it["key"] for it in got) == keys
    assert all(it["data"] == (tmp_path / "f" / it["key"]).read_bytes() for it in got)
    used, limit = ds.cache_usage()
    assert used <= limit == budget
    delete(url, "train/eel/019.jpg", opts)
    again = StreamingDataset(url, cache_dir=tmp_path / "c2", files="**/*.jpg", storage_options=opts)
    assert again.num_items == len(keys) - 1  # a new node lists anew
    stale = StreamingDataset(url, cache_dir=tmp_path / "c", files="**/*.jpg", storage_options=opts)
    assert stale.num_items == len(keys)  # this node's listing, until refreshed
    with pytest.raises(ObjectNotFoundError, match="eel/019.jpg"):
        stale[len(keys) - 1]
    assert np.all(stale.index.items_per_chunk >= 1)
