"""A ``collate_fn``'s batches travel from the workers in pooled shared-memory buffers
(:mod:`asynccache.torch.handover`): the consumer gets the same batches, bit for bit, as
the same loader without workers gives; a buffer is never written while any array of a
batch in it, or a view of one, is held; what can't move is pickled as before.

Two levels: the hand-over in one process (a worker's pool, the batch pickled as a worker
sends it and unpickled as the consumer receives it), with a property over sequences of
batches sent, held in part and dropped; and ``CacheDataLoader`` with two workers under
fork, forkserver and spawn.
"""

from __future__ import annotations

import secrets
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing  # (registers torch's reductions with the pickler)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, default_collate

from asynccache import CacheDataLoader, StreamingDataset
from asynccache.torch import batches
from asynccache.torch.handover import MIN_BYTES, hand_over

N, CHUNK = 90, 16

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


def same(a: Any, b: Any, where: str = "batch") -> None:
    """Bit-identical: types, keys, dtypes, shapes, bytes; moved arrays C-contiguous."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist(), where
        else:
            assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        if a.numel():
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    else:
        assert a == b, where


def in_pool(a: np.ndarray) -> bool:
    """``a`` is a view of a pooled buffer (the consumer's uint8 array over a tensor)."""
    return isinstance(a.base, np.ndarray) and isinstance(a.base.base, torch.Tensor)


# -- in one process --------------------------------------------------------------------
class Worker:
    """A worker's pool, and the consumer's side of its block in this same process."""

    def __init__(self, row: int = 3) -> None:
        self.block = batches.shared_bytes(batches.BLOCK_BYTES)
        self.token = secrets.token_hex(8)
        batches.register(self.token, self.block)
        self.pool = batches.Pool(self.block, self.token, row)
        self.row = row

    def send(self, batch: Any) -> Any:
        """``batch`` as the consumer gets it from this worker."""
        return ForkingPickler.loads(ForkingPickler.dumps(hand_over(batch, self.pool)))

    def busy(self) -> int:
        return int(np.count_nonzero(batches.table(self.block)[self.row, : batches.POOL_SLOTS]))

    def counters(self) -> dict[str, int]:
        return batches.counters(self.block)


def varied() -> dict[str, Any]:
    big = np.arange(40_000, dtype=np.float32)
    return {
        "f32": big,
        "again": big,  # the same array twice: one array twice in the consumer
        "be": np.arange(12, dtype=">i4").reshape(3, 4),
        "zero_d": np.array(7.5),
        "strided": np.arange(200, dtype=np.int16)[::3],  # not contiguous: arrives C-contiguous
        "fortran": np.asfortranarray(np.ones((5, 6), np.int64)),  # pickled as it is
        "objects": np.array([1, "a"], dtype=object),  # pickled as it is
        "empty": np.zeros((0, 3), np.uint8),
        "record": np.zeros(4, [("a", "<i2"), ("b", "<f8")]),
        "bf16": torch.arange(5_000, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "grad": torch.ones(3, requires_grad=True),  # pickled as it is
        "shared": torch.ones(4).share_memory_(),  # already shared: as it is
        "nested": [(np.ones(3, np.uint8), "s", b"b", 3), {"k": torch.zeros(2, 2)}],
    }


def test_every_array_arrives_as_it_was_sent():
    w = Worker()
    sent = varied()
    got = w.send(sent)
    same(got, sent)
    assert got["again"] is got["f32"]
    assert got["strided"].flags.c_contiguous and got["fortran"].flags.f_contiguous
    assert got["grad"].requires_grad and got["shared"].is_shared()
    for key in ("f32", "be", "strided", "record", "zero_d"):
        assert got[key].flags.writeable and in_pool(got[key]), key
    assert not in_pool(got["fortran"]) and not in_pool(got["objects"])
    assert w.counters()["pooled_buffers"] == 1 and w.busy() == 1
    del got
    assert w.busy() == 0, "the slot frees when the batch is dropped"


def test_what_the_batch_shares_it_shares_in_the_consumer():
    w = Worker()
    inner = [np.arange(20_000, dtype=np.int64), "x"]
    loop: list[Any] = [np.arange(5)]
    loop.append(loop)  # a cycle: pickle keeps it, so does the hand-over
    got = w.send({"twice": [inner, inner], "loop": loop, "t": (inner,)})
    assert w.counters()["pooled_buffers"] == 1, "moved"
    assert got["twice"][0] is got["twice"][1] is got["t"][0]
    assert np.array_equal(got["twice"][0][0], inner[0]) and got["twice"][0][1] == "x"
    assert got["loop"][1] is got["loop"] and np.array_equal(got["loop"][0], np.arange(5))


def test_a_view_holds_the_buffer_and_its_end_frees_it():
    w = Worker()
    got = w.send({"x": [np.arange(30_000, dtype=np.int32)], "t": torch.arange(20_000)})
    view, tview = got["x"][0][10:20], got["t"][5:]
    del got
    assert w.busy() == 1
    del view
    assert w.busy() == 1, "the tensor's view still holds the buffer"
    del tview
    assert w.busy() == 0


def test_small_batches_are_pickled_as_they_are():
    w = Worker()
    small = {"x": np.ones(MIN_BYTES // 8 - 1, np.float64), "y": [1, 2]}
    got = w.send(small)
    same(got, small)
    assert not in_pool(got["x"])
    assert w.counters()["pooled_buffers"] == 0


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["send", "drop", "keep_view"]),
            st.integers(0, 30),
            st.integers(16, 300),  # KiB: below MIN_BYTES and above
        ),
        min_size=1,
        max_size=40,
    )
)
def test_a_held_batch_never_changes(ops):
    """Any order of sends, drops and views kept: every batch still held reads what it was
    sent with, and the busy slots are exactly the held batches in pooled buffers."""
    w = Worker()
    held: list[list[Any]] = []  # [what is held, what it must read, pooled]
    serial = 0
    for op, which, size in ops:
        if op == "send" or not held:
            serial += 1
            value = np.full(size * 1024, serial % 251, np.uint8)
            before = w.counters()["unpooled_buffers"]
            held.append([w.send({"x": [value]}), value, False])
            held[-1][2] = value.nbytes >= MIN_BYTES and w.counters()["unpooled_buffers"] == before
        elif op == "drop":
            held.pop(which % len(held))
        else:  # keep only a view of the batch's array
            k = which % len(held)
            if isinstance(held[k][0], dict):
                held[k][0], held[k][1] = held[k][0]["x"][0][1:], held[k][1][1:]
        check(held, w)
    held.clear()
    assert w.busy() == 0


def check(held: list[list[Any]], w: Worker) -> None:
    for got, value, _ in held:
        assert np.array_equal(got["x"][0] if isinstance(got, dict) else got, value)
    assert w.busy() == sum(pooled for _, _, pooled in held)


# -- through the loader ------------------------------------------------------------------
class Ragged(Dataset[Any]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        rng = np.random.default_rng(i)
        return {
            "x": np.frombuffer(rng.bytes(int(rng.integers(1, 6_000))), np.uint8),
            "f": rng.standard_normal(64, dtype=np.float32),
            "id": f"item-{i}",
        }


def collate_ragged(items: list[Any]) -> dict[str, Any]:
    """What users write for ragged items: lists of arrays, a padded tensor, the strings."""
    xs = [np.asarray(it["x"]) for it in items]
    padded = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(x.copy()) for x in xs], True)
    f = np.stack([it["f"] for it in items])
    return {"x": xs, "padded": padded, "f": f, "pair": (f, f), "id": [it["id"] for it in items]}


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ragged")
    list(
        CacheDataLoader(Ragged(), cache_dir=path, chunk_size=CHUNK, batch_size=10, collate_fn=list)
    )
    return path


def ids(items: list[Any]) -> list[str]:
    return [it["id"] for it in items]


def expected(order: list[list[str]]) -> list[Any]:
    """The batches ``collate_ragged`` makes of the source's items in ``order`` (ids)."""
    src = Ragged()
    return [collate_ragged([src[int(i.split("-")[1])] for i in b]) for b in order]


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_the_workers_batches_are_what_the_collate_fn_made(ragged, context):
    def loader(collate: Any) -> tuple[CacheDataLoader, StreamingDataset]:
        ds = StreamingDataset(ragged, shuffle=True, seed=4)
        kw = {"multiprocessing_context": context, "persistent_workers": True}
        return CacheDataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate, **kw), ds

    order = [b for dl in [loader(ids)[0]] for _ in range(2) for b in dl]  # strings: pickled
    want = expected(order)
    dl, ds = loader(collate_ragged)
    sizes, moved = [], []
    for k, b in enumerate(b for _ in range(2) for b in dl):  # each batch dropped before the next
        same(b, want[k], f"batch {k}")
        assert b["pair"][0] is b["pair"][1]
        sizes.append(b["f"].nbytes + b["padded"].nbytes + sum(x.nbytes for x in b["x"]))
        moved.append(in_pool(b["x"][0]) and in_pool(b["f"]))
    assert len(sizes) == len(want) == 2 * -(-N // 8)
    assert min(sizes) < MIN_BYTES <= max(sizes), "batches to move and batches to pickle"
    assert moved == [n >= MIN_BYTES for n in sizes]
    stats = ds.batch_stats()
    assert stats["pooled_buffers"] >= 1 and stats["unpooled_buffers"] == stats["assembled"] == 0
    assert stats["sent_buffers"] <= 2 * batches.POOL_SLOTS, "each buffer mapped once"


def test_batches_held_through_the_epochs_keep_their_values(ragged):
    """The consumer holds every batch: the pools run out of free slots and send buffers
    used once, and no held batch is ever written over."""

    def run(collate: Any) -> tuple[list[Any], StreamingDataset]:
        ds = StreamingDataset(ragged, seed=1)
        kw = {"persistent_workers": True}  # one pool a worker through both epochs
        dl = CacheDataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate, **kw)
        return [b for _ in range(2) for b in dl], ds

    held, ds = run(collate_ragged)
    order, _ = run(ids)
    for k, (a, b) in enumerate(zip(held, expected(order), strict=True)):
        same(a, b, f"batch {k}")
    assert ds.batch_stats()["unpooled_buffers"] > 0, "the pools ran out of free slots"


# -- a transform: default_collate's batches --------------------------------------------------
class Images(Dataset[Any]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        pixels = np.random.default_rng(i).integers(
            0, 256, (32, 32, 3), np.uint8
        )  # a short batch of 26: 78 KiB
        return {"image": pixels, "label": i, "name": f"img-{i}", "w": np.float32(i / 3)}


def darken(item: dict[str, Any]) -> dict[str, Any]:
    """A per-item transform (module level: spawn pickles it)."""
    return {**item, "image": item["image"] // 2}


def default_by_another_name(items: list[Any]) -> Any:
    """torch's default_collate, which in a worker stacks into new shared memory."""
    return default_collate(items)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_transforms_batches_are_what_default_collate_makes(tmp_path, context):
    list(CacheDataLoader(Images(), cache_dir=tmp_path, chunk_size=CHUNK, batch_size=10))

    def run(**kw: Any) -> tuple[list[Any], StreamingDataset]:
        ds = StreamingDataset(tmp_path, shuffle=True, seed=2, transform=darken)
        dl = CacheDataLoader(
            ds, batch_size=32, num_workers=2, multiprocessing_context=context, **kw
        )
        return [b for b in dl], ds

    got, ds = run()
    ref, ref_ds = run(collate_fn=default_by_another_name)
    assert len(got) == len(ref) == -(-N // 32)
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        same(a, b, f"batch {k}")
        assert b["image"].is_shared() and not a["image"].is_shared(), "pooled, not a segment"
    assert ds.batch_stats()["pooled_buffers"] >= 1
    assert ref_ds.batch_stats()["pooled_buffers"] == 0
