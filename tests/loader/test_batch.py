"""Whole batches from the workers: bit-identical to the per-item path, buffers reused
only once the consumer let go, and the per-item path taken exactly when it must be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, default_collate

from asynccache import CacheDataLoader, MixedDataset, StreamingDataset, TokenBlocks
from asynccache.torch import batches
from tests.loader.datasets import DictDataset
from tests.tokens.corpus import documents, write_tokens

N = 90
CHUNK = 16  # items per chunk


def fixed_item(i: int) -> dict[str, Any]:
    """Every leaf kind the batch path assembles (special float values included)."""
    return {
        "x": np.full((4, 3), i, np.float32) + np.float32(0.25),
        "t": torch.arange(5, dtype=torch.int16) * i,
        "h": torch.full((2,), i / 7, dtype=torch.bfloat16),
        "y": i,
        "f": [float("nan"), -0.0, 1e300, i / 3][i % 4],
        "b": i % 2 == 0,
        "l": [np.array(i, np.uint8), i * 2, (np.float16(i) * np.ones(3, np.float16))],
        "u": (np.int64(-i) * np.ones(1, np.int64),),
    }


class Fixed(Dataset):
    def __init__(self, n: int, odd: frozenset[int] = frozenset()) -> None:
        self.n, self.odd = n, odd

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        item = fixed_item(i)
        if i in self.odd:  # a numpy scalar label: collates like an int, has no form
            item["y"] = np.int64(i)
        return item


def per_item(batch: list[Any]) -> Any:
    """default_collate behind another name: the loader collates items itself."""
    return default_collate(batch)


def same(a: Any, b: Any) -> None:
    """Bit-identical batches: same structure, types, dtypes, shapes and bytes."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.is_contiguous()
        raw = (lambda t: t.reshape(-1).view(torch.uint8)) if a.dtype != torch.bool else None
        if raw is None:
            assert torch.equal(a, b)
        else:
            assert torch.equal(raw(a), raw(b.contiguous()))


def write(path: Path, ds: Dataset) -> Path:
    list(CacheDataLoader(ds, cache_dir=path, chunk_size=CHUNK, batch_size=10))
    return path


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("fixed"), Fixed(N))


@pytest.mark.parametrize(
    ("shuffle", "drop_last", "workers", "epochs"), [(True, True, 2, 2), (False, False, 0, 2)]
)
def test_batches_are_bit_identical_to_the_per_item_path(fixed, shuffle, drop_last, workers, epochs):
    def run(**kw: Any) -> tuple[list[Any], CacheDataLoader, StreamingDataset]:
        ds = StreamingDataset(fixed, shuffle=shuffle, seed=3)
        if workers:  # the same worker processes for both epochs: their pools carry over
            kw["persistent_workers"] = True
        dl = CacheDataLoader(ds, batch_size=7, num_workers=workers, drop_last=drop_last, **kw)
        return [b for _ in range(epochs) for b in dl], dl, ds

    got, dl, ds = run()
    ref, ref_dl, ref_ds = run(collate_fn=per_item)
    assert dl.batch_fallback is None and ref_dl.batch_fallback == "a collate_fn is set"
    assert len(got) == len(ref) == epochs * len(dl)
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    assert ds.batch_stats()["assembled"] == len(got) and ds.batch_stats()["collated"] == 0
    assert ref_ds.batch_stats()["assembled"] == 0


def test_token_blocks_are_bit_identical(tmp_path):
    # Documents of many lengths in small chunks: blocks inside chunks and across them.
    write_tokens(tmp_path, documents([(i * 37) % 300 for i in range(80)]), chunk_size=9)
    runs = []
    for kw in ({}, {"collate_fn": per_item}):
        ds = StreamingDataset(tmp_path, shuffle=True, item_loader=TokenBlocks(100))
        dl = CacheDataLoader(ds, batch_size=6, num_workers=2, **kw)
        runs.append(([b for b in dl], ds))
    (got, ds), (ref, _) = runs
    assert len(got) == len(ref) > 10
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    assert ds.batch_stats()["assembled"] == len(got) and ds.batch_stats()["collated"] == 0


def test_the_per_item_path_is_taken_exactly_when_it_must(fixed, tmp_path):
    kw: dict[str, Any] = {"batch_size": 8}  # (the worker path: the tests above)
    with_transform = StreamingDataset(fixed, transform=lambda x: x)
    dl = CacheDataLoader(with_transform, batch_size=8)
    assert len(list(dl)) == len(dl)
    assert dl.batch_fallback == "a per-item transform is set"
    assert with_transform.batch_stats()["assembled"] == 0

    mixed = MixedDataset([StreamingDataset(fixed), StreamingDataset(fixed, transform=lambda x: x)])
    dl = CacheDataLoader(mixed, batch_size=8)
    assert len(list(dl)) == len(dl)
    assert dl.batch_fallback == "stream 1 of the mix has a per-item transform"

    # str leaves: whole batches from the workers too, their strings carried as lists.
    strings = write(tmp_path / "str", DictDataset(40))
    ds = StreamingDataset(strings)
    got = list(CacheDataLoader(ds, **kw))
    ref = list(CacheDataLoader(StreamingDataset(strings), batch_size=8, collate_fn=per_item))
    assert [b["name"] for b in got] == [b["name"] for b in ref]
    assert ds.batch_stats()["assembled"] == len(got) and ds.batch_stats()["collated"] == 0

    # Items without a form (a numpy scalar leaf) among fixed ones: exactly the batches
    # holding one are collated per item, the rest are assembled; all bit-identical.
    odd = frozenset({5, 6, 40, 89})
    mixed_forms = write(tmp_path / "odd", Fixed(N, odd))
    ds = StreamingDataset(mixed_forms, shuffle=True)
    got = list(CacheDataLoader(ds, **kw))
    ref_ds = StreamingDataset(mixed_forms, shuffle=True)
    ref = list(CacheDataLoader(ref_ds, batch_size=8, collate_fn=per_item))
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    holding = sum(bool(odd & set(b["y"].tolist())) for b in ref)
    assert 0 < holding < len(ref)
    assert ds.batch_stats()["collated"] == holding
    assert ds.batch_stats()["assembled"] == len(ref) - holding


def test_buffers_are_never_reused_while_held(fixed):
    """Hold every batch (or only a view, or only a numpy array of it) across a whole
    epoch: none changes, and the pool overflowed into one-off buffers to keep them."""
    ds = StreamingDataset(fixed)
    dl = CacheDataLoader(ds, batch_size=2, num_workers=2)
    ref = list(
        CacheDataLoader(StreamingDataset(fixed), batch_size=2, num_workers=2, collate_fn=per_item)
    )
    held: list[Any] = []
    for j, b in enumerate(dl):
        kind = j % 3
        held.append(b if kind == 0 else b["x"][1:] if kind == 1 else b["t"].numpy())
        del b  # (what is not held is freed now: refcounting)
    assert len(held) == len(ref) > 2 * batches.POOL_SLOTS
    for j, (h, r) in enumerate(zip(held, ref, strict=True)):
        if j % 3 == 0:
            same(h, r)
        elif j % 3 == 1:
            assert torch.equal(h, r["x"][1:])
        else:
            assert np.array_equal(h, r["t"].numpy())
    stats = ds.batch_stats()
    # (+lead: the first batches, built in the main process in buffers of their own)
    lead = ds.lead_stats.batches
    assert lead == 2
    assert stats["pooled_buffers"] == 2 * batches.POOL_SLOTS + lead
    assert stats["unpooled_buffers"] == len(held) - lead - 2 * batches.POOL_SLOTS


def test_dropped_batches_reuse_a_few_shared_buffers(fixed):
    """A consumer that drops each batch: each worker's few buffers are mapped by the main
    process once and reused, not a new shared-memory segment per batch as with
    default_collate (the batches' memory is at a handful of addresses)."""
    ds = StreamingDataset(fixed)
    seen: set[int] = set()
    n = 0
    for b in CacheDataLoader(ds, batch_size=2, num_workers=2):
        seen.add(b["x"].untyped_storage().data_ptr())
        n += 1
    stats = ds.batch_stats()
    assert n == -(-N // 2) > 2 * batches.POOL_SLOTS >= stats["pooled_buffers"] >= len(seen)
    # (-2: the first batches' buffers, in the main process, where they were built: not sent)
    assert ds.lead_stats.batches == 2
    assert stats["sent_buffers"] == stats["pooled_buffers"] - 2
    assert stats["unpooled_buffers"] == 0
    # In the main process (no workers): two buffers (the loop variable holds the previous
    # batch while the next is assembled), reused as each batch is dropped.
    ds = StreamingDataset(fixed)
    assert sum(1 for _ in CacheDataLoader(ds, batch_size=2)) == n
    assert ds.batch_stats()["pooled_buffers"] == 2 and ds.batch_stats()["unpooled_buffers"] == 0


class ChunkShapes(Dataset):
    """Arrays of one shape per chunk, another in the next: a batch over two chunks has
    no single form (its first chunk's rows are copied before the second says so)."""

    def __len__(self) -> int:
        return 3 * CHUNK

    def __getitem__(self, i: int) -> Any:
        return {"x": np.full(4 + (i // CHUNK == 1), i, np.int32), "y": i}


def test_a_batch_whose_later_chunk_differs_in_form_is_collated_per_item(tmp_path):
    path = tmp_path / "shapes"
    list(CacheDataLoader(ChunkShapes(), cache_dir=path, chunk_size=CHUNK, batch_size=CHUNK))
    ds = StreamingDataset(path)
    got = []
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        for b in CacheDataLoader(ds, batch_size=12):  # batch 1: items 12-23, two chunks
            got.append(b)
    assert [b["y"].tolist() for b in got] == [list(range(12))]
    assert ds.batch_stats()["assembled"] == 1 and ds.batch_stats()["collated"] == 1
    # Batches within one chunk each, around the chunk's edge: assembled, bit for bit.
    ds = StreamingDataset(path)
    got = list(CacheDataLoader(ds, batch_size=CHUNK))
    ref = list(CacheDataLoader(StreamingDataset(path), batch_size=CHUNK, collate_fn=per_item))
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    assert ds.batch_stats()["assembled"] == 3 and ds.batch_stats()["collated"] == 0
