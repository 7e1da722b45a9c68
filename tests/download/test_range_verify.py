"""Items of the first batch read by HTTP Range are verified before any of them is handed
out: the chunk header against the index's header checksum, each item against its
checksum in that header.

A real SeaweedFS behind the real fault proxy, which replaces an object mid-read (the
original header, then a rewritten object) or flips a byte of a range response, once or
on every attempt; the proxy holds back whole-chunk GETs (``slow``) so the first items
surely come by range.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynccache import ChecksumMismatchError, DatasetRewrittenError
from asynccache.config import Settings
from asynccache.format import ChunkView
from asynccache.format.chunk import items_start
from asynccache.testing.faults import Fault, FaultProxy
from asynccache.torch.streaming import StreamingDataset
from asynccache.write.writer import ChunkWriter
from tests.format.old_layout import write_v1_dataset
from tests.helpers import noise_item, uploaded, write_noise_dataset

pytestmark = pytest.mark.timeout(120)

N, PER_CHUNK, ITEM = 32, 8, 160 << 10  # chunks of 1.25 MiB: range reads start at 1 MiB
RETRIES = 2


def _item(i: int) -> dict[str, Any]:
    return noise_item(i, ITEM)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_noise_dataset(tmp_path_factory.mktemp("verify") / "src", N, PER_CHUNK, ITEM)


@pytest.fixture(scope="module")
def remote(written: Path, objstore: Any) -> Any:
    with uploaded(written, objstore, "verify") as url:
        yield url


def _chunk(src: Path, k: int) -> tuple[str, int, int]:
    """Name, size and first item offset of chunk ``k``."""
    name = sorted(f for f in os.listdir(src) if f.endswith(".bin"))[k]
    data = (src / name).read_bytes()
    return name, len(data), ChunkView(data, name).span(0)[0]


def _budget(size: int, items: int) -> int:
    """A range-read budget that covers ``items`` items of chunks of ``size`` bytes and
    not one more (the reader counts each item as ``size // PER_CHUNK``)."""
    return items * (size // PER_CHUNK) + ITEM // 2


def _dataset(url: Any, options: dict[str, Any], tmp_path: Path, early: int) -> StreamingDataset:
    settings = Settings.from_env(
        progress=False,
        first_read_bytes=early,
        retries=RETRIES,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
    )
    return StreamingDataset(
        url, cache_dir=tmp_path / "cc", storage_options=options, settings=settings
    )


def _hold_whole_chunks(proxy: FaultProxy, size: int, stall_s: float = 0.5) -> None:
    whole = f"bytes=0-{size - 1}"
    proxy.add_fault(Fault("slow", path=".bin", range=whole, stall_s=stall_s, times=N))


def _same(got: dict[str, Any], i: int) -> bool:
    return bool(got["i"] == i and np.array_equal(got["x"], _item(i)["x"]))


def test_a_chunk_replaced_after_the_index_was_opened_hands_out_none_of_its_bytes(
    remote, written, objstore, tmp_path
):
    """Chunk 1 is rewritten (same shapes and size, other values) between its header's
    range read and its items': not one item of the new bytes reaches the consumer; the
    error names the chunk and says it was rewritten."""
    name0, size, _ = _chunk(written, 0)
    name1, size1, _ = _chunk(written, 1)
    assert size1 == size
    other = tmp_path / "other"
    w = ChunkWriter(str(other), 0, chunk_size=PER_CHUNK)
    for j in range(PER_CHUNK):
        w.add(j, {"i": PER_CHUNK + j, "x": noise_item(1000 + j, ITEM)["x"]})
    w.finish()
    rewritten = (other / "chunk-0-0.bin").read_bytes()
    assert len(rewritten) == size1 and rewritten != (written / name1).read_bytes()
    with FaultProxy(objstore.endpoint_url) as proxy:
        _hold_whole_chunks(proxy, size)
        # The first GET of chunk 1 (its header, by range) sees the original; every
        # request after it, the rewritten object.
        proxy.replace_object(name1, rewritten, after=1)
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        # The first 12 items by range: all of chunk 0, the first 4 of chunk 1.
        ds = _dataset(remote, options, tmp_path, _budget(size, 12))
        got = []
        with pytest.raises(DatasetRewrittenError) as err:
            for x in ds:
                got.append(x)
        assert proxy.fired("replace") >= 1
        ranged = [r for r in proxy.requests if r.path.endswith(name1) and r.range]
        assert ranged[0].range == f"bytes=0-{items_start(PER_CHUNK) - 1}"  # the original
        ds.close()
    # Every item handed out before the error is the original; none of chunk 1.
    assert len(got) == PER_CHUNK
    for i, x in enumerate(got):
        assert _same(x, i), i
    assert name1 in str(err.value) and "rewritten" in str(err.value)
    assert name0 not in str(err.value)


@pytest.mark.parametrize("where", ["item", "header"])
def test_a_byte_flipped_in_one_range_response_is_fetched_again(
    remote, written, objstore, tmp_path, where
):
    """One damaged range response (an item's, or the header's) costs one more GET of
    that range: the epoch gives exactly the original items."""
    name, size, first = _chunk(written, 0)
    with FaultProxy(objstore.endpoint_url) as proxy:
        _hold_whole_chunks(proxy, size)
        if where == "item":  # a byte inside item 0's array
            proxy.add_fault(Fault("flip", path=name, range=f"bytes={first}-", flip_at=ITEM // 2))
        else:  # a byte of the offsets table
            head = f"bytes=0-{items_start(PER_CHUNK) - 1}"
            proxy.add_fault(Fault("flip", path=name, range=head, flip_at=30))
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(remote, options, tmp_path, _budget(size, 4))
        got = list(ds)
        assert proxy.fired("flip") == 1
        stats = ds.source.stats
        ds.close()
    # Header, items, and the damaged one again; for an item, its header once more (it
    # still matches the index: not a rewrite). Nothing else by range.
    assert stats.range_gets == (4 if where == "item" else 3), stats
    assert stats.retries >= 1
    assert len(got) == N
    for i, x in enumerate(got):
        assert _same(x, i), i


def test_a_range_damaged_on_every_attempt_is_a_checksum_error_naming_chunk_and_key(
    remote, written, objstore, tmp_path
):
    """The same byte flipped in every response of item 0's range while the object stays
    as it is (its size and ETag): after the retry budget, ChecksumMismatchError naming
    the chunk and the item's key; the item is never handed out."""
    name, size, first = _chunk(written, 0)
    with FaultProxy(objstore.endpoint_url) as proxy:
        _hold_whole_chunks(proxy, size, stall_s=2.0)
        flips = Fault("flip", path=name, range=f"bytes={first}-", flip_at=ITEM // 2, times=100)
        proxy.add_fault(flips)
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(remote, options, tmp_path, _budget(size, 4))
        it = iter(ds)
        with pytest.raises(ChecksumMismatchError) as err:
            next(it)  # item 0: no damaged copy of it is ever returned
        assert proxy.fired("flip") == RETRIES + 1
        it.close()
        ds.close()
    msg = str(err.value)
    assert name in msg and "key 0" in msg, msg
    assert not isinstance(err.value, DatasetRewrittenError) and "damaged" in msg, msg


@pytest.mark.parametrize("columns", [True, False], ids=["index-v2", "index-v1"])
def test_a_dataset_of_the_previous_format_reads_its_first_items_from_whole_chunks(
    objstore, tmp_path, columns
):
    """Chunks of version 1 carry no item checksums and their index no header checksum:
    their items can't be verified before the whole chunk is here, so none is read by
    range; every item still reads correctly."""
    src = write_v1_dataset(tmp_path / "old", N, PER_CHUNK, _item, columns=columns)
    name, size, _ = _chunk(src, 0)
    assert (src / name).read_bytes()[8] == 1  # chunk version 1
    with uploaded(src, objstore, "old") as url, FaultProxy(objstore.endpoint_url) as proxy:
        _hold_whole_chunks(proxy, size, stall_s=0.2)
        options = dict(objstore.storage_options, endpoint_url=proxy.url)
        ds = _dataset(url, options, tmp_path, _budget(size, 12))
        got = list(ds)
        stats = ds.source.stats
        ds.close()
    assert stats.range_gets == 0 and stats.chunks_fetched == N // PER_CHUNK
    assert len(got) == N
    for i, x in enumerate(got):
        assert _same(x, i), i
