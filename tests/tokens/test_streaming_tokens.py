"""Token blocks streamed from the local S3 server: every block once, exact resume."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from asynccache import CacheDataLoader, ResumeStateError, StreamingDataset, TokenBlocks, optimize
from asynccache.config import Settings
from asynccache.errors import DataError
from asynccache.testing.resume import assert_resumes_exactly
from asynccache.torch.fetcher import Fetcher

from .corpus import LENGTHS, TOTAL, block_numbers, position_doc

L, B = 300, 4  # ~8 KiB chunks hold ~2000 tokens: some blocks span two chunks
N_BLOCKS = TOTAL // L


@pytest.fixture(scope="module")
def remote(objstore):
    """The position corpus written by optimize(tokens=) straight into a bucket."""
    bucket = "tok-" + os.urandom(4).hex()
    objstore.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    optimize(
        position_doc, list(range(len(LENGTHS))), url, num_workers=0, chunk_bytes=8192,
        tokens="uint32", storage_options=objstore.storage_options,
        settings=Settings.from_env(progress=False),
    )  # fmt: skip
    return url, objstore.storage_options


def dataset(remote, cache_dir, **kw):
    url, opts = remote
    kw.setdefault("shuffle", True)
    return StreamingDataset(
        url, cache_dir=cache_dir, seed=3, storage_options=opts, shuffle_window=2,
        item_loader=TokenBlocks(block_size=L), **kw,
    )  # fmt: skip


def test_every_block_once_and_the_length_from_the_index(remote, tmp_path):
    ds = dataset(remote, tmp_path / "cache")
    opened = ds.download_stats()["chunks_fetched"]  # (what opening the index fetched)
    assert len(ds.index.chunks) > 4
    assert ds.num_items == len(ds) == N_BLOCKS == TOTAL // L
    assert ds.download_stats()["chunks_fetched"] == opened, "len() opened no chunk"
    got = []
    for batch in CacheDataLoader(ds, batch_size=B, num_workers=2):
        got += block_numbers(batch, L)
    assert sorted(got) == list(range(N_BLOCKS)), "every block once, none dropped"
    assert got != sorted(got), "shuffled"
    stats = ds.download_stats()
    assert stats["chunks_fetched"] - opened == len(ds.index.chunks), "each chunk once"
    assert block_numbers(np.stack([ds[7], ds[N_BLOCKS - 1]]), L) == [7, N_BLOCKS - 1]
    with pytest.raises(IndexError):
        ds[N_BLOCKS]


def keys_run(dl, stop=None, state=None):
    if state is not None:
        dl.load_state_dict(pickle.loads(pickle.dumps(state)))
    got = []
    with Fetcher(dl, prefetch_batches=3) as f:
        for i, batch in enumerate(f):
            got += block_numbers(batch, L)
            if stop is not None and i + 1 == stop:
                return got, f.state_dict()
        return got, f.state_dict()


def test_resume_from_one_worker_to_four(remote, tmp_path):
    cache = tmp_path / "cache"
    pre, state = keys_run(CacheDataLoader(dataset(remote, cache), batch_size=B, num_workers=1), 5)
    dl = CacheDataLoader(dataset(remote, cache), batch_size=B, num_workers=4)
    post, _ = keys_run(dl, state=state)
    assert len(pre) == 5 * B
    assert sorted(pre + post) == list(range(N_BLOCKS)), "nothing repeated, nothing missed"


def test_resume_exactly_in_the_same_order(remote, tmp_path):
    cache = tmp_path / "cache"
    n_batches = -(-N_BLOCKS // B)
    assert_resumes_exactly(
        lambda: CacheDataLoader(dataset(remote, cache), batch_size=B, num_workers=2),
        [0, 3, n_batches - 1],
    )


def test_a_state_of_another_block_size_or_of_items_is_refused(remote, tmp_path):
    cache = tmp_path / "cache"
    dl = CacheDataLoader(dataset(remote, cache), batch_size=B, num_workers=0)
    _, state = keys_run(dl, 2)
    url, opts = remote
    other = StreamingDataset(
        url, cache_dir=cache, seed=3, storage_options=opts, shuffle=True, shuffle_window=2,
        item_loader=TokenBlocks(block_size=L + 1),
    )  # fmt: skip
    with pytest.raises(ResumeStateError, match="item_loader"):
        CacheDataLoader(other, batch_size=B).load_state_dict(state)
    items = StreamingDataset(
        url, cache_dir=cache, seed=3, storage_options=opts, shuffle=True, shuffle_window=2
    )
    with pytest.raises(ResumeStateError, match="item_loader"):
        CacheDataLoader(items, batch_size=B).load_state_dict(state)


def test_an_item_dataset_is_refused_as_token_blocks(tmp_path):
    from asynccache.write.writer import ChunkWriter, merge_dir

    w = ChunkWriter(str(tmp_path), 0)
    w.add(0, np.arange(5))
    w.finish()
    merge_dir(str(tmp_path), [0])
    with pytest.raises(DataError, match="not a token dataset"):
        StreamingDataset(tmp_path, item_loader=TokenBlocks(4))
