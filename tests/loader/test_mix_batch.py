"""A mix's whole batches from the workers: each stream copies its rows into one buffer,
bit-identical to the per-item path in every mode (tags, blocks that span chunks and
short last batches included), and the per-item path taken exactly when it must."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

from asynccache import CacheDataLoader, MixedDataset, Stream, StreamingDataset, TokenBlocks
from asynccache.write.writer import ChunkWriter, merge_dir
from tests.loader.mix_data import mix, pairs, write_streams
from tests.loader.test_batch import per_item, same
from tests.tokens.corpus import documents, write_tokens

pytestmark = pytest.mark.timeout(120)
L = 50  # tokens per block; chunks of 9 documents hold a few blocks, some span two


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mixbatch")
    tokens = []
    for k in range(3):
        d = root / f"tok{k}"
        lengths = [(i * 37 + k * 11) % 150 for i in range(30 + 6 * k)]
        write_tokens(str(d), documents(lengths, seed=k), chunk_size=9)
        tokens.append(str(d))
    # Stream 1's "i" is a numpy scalar: it collates like an int but has no form.
    odd = str(root / "odd")
    w = ChunkWriter(odd, 0, chunk_size=20)
    for i in range(60):
        w.add(i, {"s": 1, "i": np.int64(i)})
    w.finish()
    merge_dir(odd, [0])
    return {"tokens": tokens, "items": write_streams(str(root / "items")), "odd": odd}


def token_mix(paths: list[str], mode: str, bs: int, **kw: Any) -> MixedDataset:
    streams = [
        Stream(StreamingDataset(p, shuffle=True, seed=k, item_loader=TokenBlocks(L)), weight=k + 1)
        for k, p in enumerate(paths)
    ]
    return MixedDataset(streams, mode=mode, batch_size=bs, seed=1, **kw)


def both(make: Any, bs: int, workers: int, drop_last: bool = False) -> tuple[list, list, Any]:
    """The batches of the mix's batch path and of the per-item path (a collate_fn set),
    the same loader otherwise; and the batch path's dataset."""
    out = []
    for kw in ({}, {"collate_fn": per_item}):
        ds = make()
        dl = CacheDataLoader(ds, batch_size=bs, num_workers=workers, drop_last=drop_last, **kw)
        out.append((list(dl), ds, dl))
    (got, ds, dl), (ref, _, ref_dl) = out
    assert dl.batch_fallback is None and ref_dl.batch_fallback == "a collate_fn is set"
    assert len(got) == len(ref) > 3
    for a, b in zip(got, ref, strict=True):
        same(a, b)
    return got, ref, ds


@pytest.mark.parametrize(
    ("mode", "tag", "workers", "drop_last"),
    [("random", True, 2, False), ("stratified", False, 0, True), ("per_stream", True, 0, False)],
)
def test_token_mix_batches_are_bit_identical(data, mode, tag, workers, drop_last):
    bs = 6
    got, _ref, ds = both(
        lambda: token_mix(data["tokens"], mode, bs, tag=tag, drop_last=drop_last),
        bs,
        workers,
        drop_last,
    )
    assert ds.batch_stats()["assembled"] == len(got) and ds.batch_stats()["collated"] == 0
    rows = [b[1] if tag else b for b in got]
    assert all(r.shape[1] == L for r in rows)
    if tag:  # the tags are the streams, and every stream is read
        assert {int(s) for b in got for s in b[0]} == {0, 1, 2}
    if mode == "random" and not drop_last:
        assert len(rows[-1]) < bs  # the short last batch, assembled too
    if mode == "per_stream":
        assert all(len(set(b[0].tolist())) == 1 for b in got), "every batch from one stream"


def test_item_mix_batches_are_bit_identical(data):
    got, _ref, ds = both(lambda: mix(data["items"], "random", batch_size=7), 7, 0)
    assert ds.batch_stats()["assembled"] == len(got) and ds.batch_stats()["collated"] == 0
    assert {int(s) for b in got for s in b["s"]} == {0, 1, 2}


def test_the_per_item_path_is_taken_exactly_when_it_must(data):
    # Rows of a stream without a form: exactly the batches holding one are collated.
    def odd_mix() -> MixedDataset:
        streams = [
            Stream(StreamingDataset(data["items"][0], shuffle=True), weight=19),
            Stream(StreamingDataset(data["odd"]), weight=1),
        ]
        return MixedDataset(streams, mode="random", seed=2)

    _got, ref, ds = both(odd_mix, 8, 0)
    holding = sum(1 in b["s"].tolist() for b in ref)
    assert 0 < holding < len(ref)
    assert ds.batch_stats()["collated"] == holding
    assert ds.batch_stats()["assembled"] == len(ref) - holding

    # Token streams of another block size: every batch but per_stream's mixes them.
    other = StreamingDataset(data["tokens"][1], item_loader=TokenBlocks(L + 1))
    differ = MixedDataset([StreamingDataset(data["tokens"][0], item_loader=TokenBlocks(L)), other])
    dl = CacheDataLoader(differ, batch_size=4)
    assert dl._batch_fallback(differ) == (
        f"the mix's streams differ in sample form (stream 0: {L} x uint16, stream 1: "
        f"{L + 1} x uint16)"
    )
    pure = MixedDataset(
        [
            StreamingDataset(data["tokens"][0], item_loader=TokenBlocks(L)),
            StreamingDataset(data["items"][0]),
        ],
        mode="per_stream",
        batch_size=4,
    )
    dl = CacheDataLoader(pure, batch_size=4)
    kinds = {type(b).__name__ for b in dl}
    assert dl.batch_fallback is None and kinds == {"Tensor", "dict"}
    assert pure.batch_stats()["assembled"] == len(dl) and pure.batch_stats()["collated"] == 0

    streams = [
        StreamingDataset(data["items"][0]),
        StreamingDataset(data["items"][1], transform=lambda x: x),
    ]
    transformed = MixedDataset(streams)
    dl = CacheDataLoader(transformed, batch_size=4)
    assert len(list(dl)) == len(dl)
    assert dl.batch_fallback == "stream 1 of the mix has a per-item transform"
    assert transformed.batch_stats()["assembled"] == 0


@pytest.mark.parametrize("mode", ["random", "stratified"])
def test_resume_with_another_worker_count_as_the_per_item_path_does(data, mode):
    """Stopped with 2 workers and resumed with none (the rest split anew): the batch
    path's samples and states are the per-item path's, interrupted alike."""

    def interrupted(**kw: Any) -> tuple[list[tuple[int, int]], dict[str, Any]]:
        dl = CacheDataLoader(
            mix(data["items"], mode, batch_size=8), batch_size=8, num_workers=2, **kw
        )
        it = iter(dl)
        got = pairs([next(it) for _ in range(5)])
        state = dl.state_dict()
        del it
        again = CacheDataLoader(mix(data["items"], mode, batch_size=8), batch_size=8, **kw)
        again.load_state_dict(state)
        return got + pairs(list(again)), state

    got, state = interrupted()
    ref, ref_state = interrupted(collate_fn=per_item)
    assert got == ref and state == ref_state
    whole = list(CacheDataLoader(mix(data["items"], mode, batch_size=8), batch_size=8))
    assert collections.Counter(got) == collections.Counter(pairs(whole)), "none lost or repeated"
