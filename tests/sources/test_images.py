"""Encoded images are kept as written: a PIL image opened from a JPEG, PNG or WebP file is
stored as the file's bytes (when they decode to exactly that image), images made or changed
in memory are encoded losslessly, and ``DecodeImages`` opens ``bytes`` leaves in the worker."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import msgpack
import numpy as np
import pytest
from PIL import Image

from asynccache.cache import indexfile
from asynccache.errors import DataError
from asynccache.format import decode, encode
from asynccache.format.images import DecodeImages, image_format, kept_bytes
from asynccache.read.reader import Reader
from asynccache.testing.photos import jpeg_bytes, photo
from asynccache.write.writer import ChunkWriter, merge_dir


def _roundtrip(item: object, **kw: object) -> tuple[object, list[object]]:
    pieces = encode(item, **kw)  # type: ignore[arg-type]
    buf = b"".join(bytes(p) for p in pieces)
    (hlen,) = np.frombuffer(buf[:4], "<u4")
    tree, _ = msgpack.unpackb(buf[4 : 4 + int(hlen)], raw=False)
    return decode(buf, 0, len(buf), where="t"), tree


def _write(path: Path, fmt: str, seed: int = 0, **save: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(photo(seed, 96, 64)).save(out, format=fmt, **save)
    path.write_bytes(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize(("fmt", "save"), [("JPEG", {"quality": 90}), ("PNG", {}), ("WEBP", {})])
def test_opened_file_is_kept_byte_for_byte(tmp_path: Path, fmt: str, save: dict) -> None:
    data = _write(tmp_path / "a.img", fmt, **save)
    img = Image.open(tmp_path / "a.img")
    back, tree = _roundtrip({"image": img, "label": 3})
    node = tree[2][0]
    assert node[0] == "p" and node[3] == fmt and node[5] == "kept"
    out = back["image"]  # type: ignore[index]
    assert out.format == fmt and out.size == (96, 64)
    # Written again before its pixels are read, the image read back keeps the same bytes.
    again, tree2 = _roundtrip(out)
    assert tree2[-1] == "kept"
    assert again.format == fmt  # type: ignore[attr-defined]
    assert pixels(out) == pixels(Image.open(io.BytesIO(data)))
    assert pixels(again) == pixels(out)  # type: ignore[arg-type]


def pixels(img: Image.Image) -> bytes:
    img.load()
    return img.tobytes()


def test_loaded_image_is_kept_from_its_file_by_the_writer(tmp_path: Path) -> None:
    data = _write(tmp_path / "a.jpg", "JPEG", quality=90)
    img = Image.open(tmp_path / "a.jpg")
    img.load()  # closes the file: the bytes come from img.filename
    assert img.fp is None
    w = ChunkWriter(str(tmp_path / "ds"), 0)
    w.add(0, {"image": img})
    w.finish()
    merge_dir(str(tmp_path / "ds"), [0])
    chunk = (tmp_path / "ds" / "chunk-0-0.bin").read_bytes()
    assert data in chunk  # the file's bytes, as they were
    idx = indexfile.read_dir(str(tmp_path / "ds"))
    r = Reader(idx, lambda ci, e: str(tmp_path / "ds" / e.filename))
    assert r[0]["image"].format == "JPEG"
    assert pixels(r[0]["image"]) == pixels(Image.open(io.BytesIO(data)))


def test_edited_or_in_memory_images_are_encoded_losslessly(tmp_path: Path) -> None:
    _write(tmp_path / "a.jpg", "JPEG", quality=90)
    edited = Image.open(tmp_path / "a.jpg")
    edited.load()
    edited.putpixel((0, 0), (1, 2, 3))
    from asynccache.write.writer import original_image_bytes

    back, tree = _roundtrip(edited, image_bytes=original_image_bytes)
    assert len(tree) == 5 and tree[3] == "PNG"  # not kept: its pixels differ from the file's
    assert pixels(back) == pixels(edited)  # type: ignore[arg-type]

    small = Image.open(tmp_path / "a.jpg")
    small.thumbnail((20, 20))
    back, tree = _roundtrip(small, image_bytes=original_image_bytes)
    assert len(tree) == 5 and back.size == small.size  # type: ignore[attr-defined]

    made = Image.fromarray(photo(1, 32, 16))
    back, tree = _roundtrip(made)
    assert len(tree) == 5 and pixels(back) == pixels(made)  # type: ignore[arg-type]


def test_file_changed_since_open_is_not_kept(tmp_path: Path) -> None:
    _write(tmp_path / "a.jpg", "JPEG", seed=1, quality=90)
    img = Image.open(tmp_path / "a.jpg")
    img.load()
    _write(tmp_path / "a.jpg", "JPEG", seed=2, quality=90)  # same size, other pixels
    from asynccache.write.writer import original_image_bytes

    back, tree = _roundtrip(img, image_bytes=original_image_bytes)
    assert len(tree) == 5
    assert pixels(back) == pixels(img)  # type: ignore[arg-type]


def test_kept_bytes_refuses_what_does_not_decode_to_the_image(tmp_path: Path) -> None:
    data = _write(tmp_path / "a.png", "PNG")
    img = Image.open(tmp_path / "a.png")
    assert kept_bytes(img, data)
    assert not kept_bytes(img, None)
    assert not kept_bytes(img, data[:100])  # truncated: does not open
    assert not kept_bytes(img, jpeg_bytes(0, 96, 64))  # another format


def test_obvious_imagenet_like_write_keeps_jpeg_size(tmp_path: Path) -> None:
    """Written ``c[i] = {"image": Image.open(p), "label": y}``, a dataset of JPEGs takes
    about the JPEGs' bytes, not several times that (PNG)."""
    total = 0
    w = ChunkWriter(str(tmp_path / "ds"), 0)
    for i in range(12):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(jpeg_bytes(i, 160, 120))
        total += p.stat().st_size
        w.add(i, {"image": Image.open(p), "label": i % 3})
    w.finish()
    merge_dir(str(tmp_path / "ds"), [0])
    stored = (tmp_path / "ds" / "chunk-0-0.bin").stat().st_size
    assert stored < total * 1.2


def test_decode_images_transform() -> None:
    jpg = jpeg_bytes(3, 40, 30)
    out = io.BytesIO()
    Image.fromarray(photo(4, 20, 10)).save(out, format="PNG")
    item = {"a": jpg, "b": [out.getvalue(), b"plain"], "c": 7, "d": b"\xff\xd8\xffbroken"}
    t = DecodeImages(keys=["a", "b"])
    got = pickle.loads(pickle.dumps(t))(item)
    assert got["a"].format == "JPEG" and got["a"].size == (40, 30)
    assert got["b"][0].format == "PNG" and got["b"][1] == b"plain"
    assert got["c"] == 7 and got["d"] == item["d"]  # not selected: untouched
    arr = DecodeImages(to="numpy")({"a": jpg})["a"]
    assert arr.shape == (30, 40, 3) and arr.dtype == np.uint8
    with pytest.raises(DataError, match=r"item\['d'\]: JPEG bytes do not decode"):
        DecodeImages(to="numpy")(item)
    assert image_format(b"RIFF\0\0\0\0WEBPVP8 ") == "WEBP"
