"""The item shapes users bring, for the side-by-side matrix (``compare.py --shapes``).

A shape is how one item looks (a bare array, a dict of an image and a label, encoded JPEG
bytes with a label and a path, a small array with scalars and a string, a ragged array,
token blocks, a 4 MiB array), how many of them make ``--total-mb``, and what the user's
loader does with it: a per-item ``transform`` (the JPEG decoded in the worker), a
``collate_fn`` (ragged arrays can't be stacked). Item ``i`` comes from a generator seeded
by ``i``: every library writes the same items, and the loader ceiling holds the same items
in RAM. Everything here is importable by a spawned process (the writers run in one).

Each library's writer gets the items its own way: asynccache and litdata take the pytree
(``optimize``); mosaic's ``MDSWriter`` takes a dict of typed columns (a bare array is the
column ``x``; token blocks are fixed-size ``ndarray`` samples, as mosaic users write them).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

KIB, MIB = 1 << 10, 1 << 20
JPEG_SIDE, JPEG_POOL = 352, 32  # noise at quality 90: ~110 KiB encoded
TOKEN_BLOCK = 2049
DOC_TOKENS = 8192  # documents of 1 to this many uint16 tokens


# -- items --------------------------------------------------------------------------------------
def item_array(i: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(i).bytes(100 * KIB), np.uint8)


def item_image_label(i: int) -> dict[str, Any]:
    return {"image": item_array(i), "label": i}


_JPEGS: list[bytes] = []


def jpeg_pool() -> list[bytes]:
    """``JPEG_POOL`` distinct noise images, encoded (item ``i`` holds image ``i % pool``)."""
    if not _JPEGS:
        from PIL import Image

        for k in range(JPEG_POOL):
            rng = np.random.default_rng(10_000 + k)
            out = io.BytesIO()
            pixels = rng.integers(0, 256, (JPEG_SIDE, JPEG_SIDE, 3), np.uint8)
            Image.fromarray(pixels).save(out, format="JPEG", quality=90)
            _JPEGS.append(out.getvalue())
    return _JPEGS


def item_jpeg(i: int) -> dict[str, Any]:
    return {
        "jpeg": jpeg_pool()[i % JPEG_POOL],
        "label": i,
        "path": f"train/{i // 1000:04d}/{i:08d}.jpg",
    }


def item_small(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"x": rng.standard_normal(256, dtype=np.float32), "y": i, "w": i / 7, "id": f"s{i:09d}"}


def item_ragged(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return np.frombuffer(rng.bytes(int(rng.integers(1 * KIB, 200 * KIB + 1))), np.uint8)


def item_large(i: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(i).bytes(4 * MIB), np.uint8)


def item_doc(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 50_000, int(rng.integers(1, DOC_TOKENS + 1)), np.uint16)


# -- what the user's loader does ------------------------------------------------------------------
def decode_jpeg(item: dict[str, Any]) -> dict[str, Any]:
    """The per-item transform of ``jpeg_decoded``: the image decoded by PIL in the worker."""
    from PIL import Image

    with Image.open(io.BytesIO(item["jpeg"])) as img:
        pixels = np.asarray(img.convert("RGB"))
    return {"image": pixels, "label": item["label"], "path": item["path"]}


def collate_list(batch: list[Any]) -> list[Any]:
    """The ``collate_fn`` of ragged arrays (they can't be stacked): the list of them."""
    return [np.asarray(x) for x in batch]


@dataclass(frozen=True)
class Shape:
    """One shape of the matrix.

    ``make(i)``: item ``i`` (a document of tokens, for a token shape); ``item_bytes``: the
    payload of an item, about (``--total-mb`` / it = the item count unless ``items``
    fixes it); ``transform`` / ``collate``: the user's per-item transform and collate_fn
    (either forces asynccache's per-item path); ``block``: tokens per sample (a token
    shape: samples are blocks of the token stream).
    """

    name: str
    make: Callable[[int], Any]
    item_bytes: int
    items: int | None = None
    transform: Callable[[Any], Any] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    block: int = 0

    @property
    def per_item(self) -> bool:
        """asynccache reads it item by item (no batch-native path)."""
        return self.transform is not None or self.collate is not None

    def count(self, total_mb: int | None) -> int:
        """Items written (documents, for a token shape) for ``total_mb`` MiB."""
        if total_mb is None and self.items is not None:
            return self.items
        total = (total_mb or 1024) * MIB
        if self.block:
            return max(
                1, total // (DOC_TOKENS + 1)
            )  # uint16 documents of DOC_TOKENS / 2 on average
        return max(1, total // self.item_bytes)

    def mosaic_columns(self) -> dict[str, str]:
        return {
            "array": {"x": f"ndarray:uint8:{100 * KIB}"},
            "image_label": {"image": f"ndarray:uint8:{100 * KIB}", "label": "int"},
            "jpeg_decoded": {"jpeg": "bytes", "label": "int", "path": "str"},
            "jpeg_raw": {"jpeg": "bytes", "label": "int", "path": "str"},
            "small_mixed": {"x": "ndarray:float32:256", "y": "int", "w": "float64", "id": "str"},
            "ragged": {"x": "ndarray:uint8"},
            "tokens": {"tokens": f"ndarray:uint16:{self.block}"},
            "large": {"x": f"ndarray:uint8:{4 * MIB}"},
        }[self.name]


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("array", item_array, 100 * KIB),
        Shape("image_label", item_image_label, 100 * KIB),
        Shape("jpeg_decoded", item_jpeg, 110 * KIB, transform=decode_jpeg),
        Shape("jpeg_raw", item_jpeg, 110 * KIB),
        Shape("small_mixed", item_small, 1100, items=200_000),
        Shape("ragged", item_ragged, 100 * KIB, collate=collate_list),
        Shape("tokens", item_doc, 2 * TOKEN_BLOCK, block=TOKEN_BLOCK),
        Shape("large", item_large, 4 * MIB),
    )
}


def token_blocks(n_docs: int, block: int) -> np.ndarray:
    """The token stream of documents ``0 .. n_docs - 1``, as ``(blocks, block)`` rows (the
    partial block at the end dropped)."""
    stream = np.concatenate([item_doc(i) for i in range(n_docs)])
    k = len(stream) // block
    return stream[: k * block].reshape(k, block)


def ram_items(shape: Shape, n: int) -> list[Any]:
    """The items (token blocks) of ``shape`` in RAM, for the loader ceiling."""
    if shape.block:
        return list(token_blocks(n, shape.block))
    return [_own_values(shape.make(i)) for i in range(n)]


def _own_values(item: Any) -> Any:
    """``item`` with a bytes object of its own for each bytes value, as a dataset held in
    RAM has. The JPEG shapes draw their values from a pool of shared objects: a worker's
    pickle sends a value met twice in a batch once (its memo), so the loader over RAM
    sent half the bytes of an in-order batch of 64 and less still shuffled."""
    if isinstance(item, dict):
        return {k: bytes(bytearray(v)) if isinstance(v, bytes) else v for k, v in item.items()}
    return item


def mosaic_samples(shape: Shape, n: int) -> Iterator[dict[str, Any]]:
    """The samples mosaic's writer gets: the items as dicts of its columns."""
    if shape.block:
        for row in token_blocks(n, shape.block):
            yield {"tokens": row}
        return
    for i in range(n):
        item = shape.make(i)
        yield item if isinstance(item, dict) else {"x": item}


class RamShape(IterableDataset[Any]):
    """The items in RAM yielded the way ``StreamingDataset`` yields them (each worker whole
    batches, worker ``j`` the batches ``j, j + W, ...`` of the epoch order), through the
    shape's transform: the loader ceiling (iii)."""

    def __init__(
        self, items: list[Any], batch: int, shuffle: bool, seed: int, transform: Any = None
    ) -> None:
        self.items, self.batch, self.shuffle, self.seed = items, batch, shuffle, seed
        self.transform = transform

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        n = len(self.items)
        order = np.random.default_rng(self.seed).permutation(n) if self.shuffle else range(n)
        for start in range(w * self.batch, n, nw * self.batch):
            for i in order[start : start + self.batch]:
                item = self.items[i]
                yield self.transform(item) if self.transform is not None else item


def payload(shape: Shape, n: int) -> int:
    """Bytes of the payload of ``n`` items (documents) of ``shape``: what a GiB of it is."""
    if shape.block:
        return 2 * sum(len(item_doc(i)) for i in range(n))
    if shape.name == "ragged":
        return sum(len(item_ragged(i)) for i in range(n))
    if shape.name.startswith("jpeg"):
        pool = jpeg_pool()
        return sum(len(pool[i % JPEG_POOL]) for i in range(n))
    return n * shape.item_bytes


def samples(shape: Shape, n: int) -> int:
    """Samples of an epoch: items, or token blocks."""
    if shape.block:
        return int(sum(len(item_doc(i)) for i in range(n)) // shape.block)
    return n


__all__ = [
    "SHAPES",
    "RamShape",
    "Shape",
    "collate_list",
    "decode_jpeg",
    "mosaic_samples",
    "payload",
    "ram_items",
    "samples",
]
