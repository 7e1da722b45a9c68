"""The Fetcher's device hand-over on CPU, with fake CUDA primitives: which device the
producer thread uses, when a pinned source buffer may be reused, which thread moves
what, and how batch containers are rebuilt."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import threading
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import asynccache.torch.fetcher as fetcher_module
from asynccache.torch._device import DeviceTransfer, iter_tensors, make_transfer, map_tensors
from asynccache.torch.fetcher import Fetcher
from tests.test_fetcher import THREAD_NAME, FakeOps, fetcher_threads, no_thread_left_behind

__all__ = ["no_thread_left_behind"]  # the autouse fixture, shared with test_fetcher

GPU_CHECK = Path(__file__).parent / "gpu" / "fetcher_check.py"


def use_fake_cuda(monkeypatch: pytest.MonkeyPatch, ops: FakeOps) -> None:
    """Fetchers built from now on copy through ``ops`` as if CUDA were there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        fetcher_module,
        "make_transfer",
        lambda device, **kw: DeviceTransfer(device, ops=ops, **kw),
    )


def copies(ops: FakeOps) -> list[tuple[Any, ...]]:
    return [entry for entry in ops.log if entry[0] == "copy"]


# -- 1. the producer thread's device --------------------------------------------


@pytest.mark.timeout(20)
def test_the_producer_thread_sets_the_target_device_first(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = FakeOps()
    use_fake_cuda(monkeypatch, ops)
    first_copy_after_set: list[bool] = []
    original_new_stream = ops.new_stream

    def new_stream(device: torch.device) -> str:
        first_copy_after_set.append(bool(ops.devices_set))
        return original_new_stream(device)

    ops.new_stream = new_stream  # type: ignore[method-assign]
    batches = [torch.ones(1) for _ in range(3)]
    assert len(list(Fetcher(batches, prefetch_batches=2, device="cuda:1"))) == 3
    assert ops.devices_set == [(THREAD_NAME, torch.device("cuda", 1))]
    assert first_copy_after_set == [True]  # set before the stream was made


@pytest.mark.timeout(20)
def test_no_thread_no_device_change(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = FakeOps()
    use_fake_cuda(monkeypatch, ops)
    list(Fetcher([torch.ones(1)], prefetch_batches=0, device="cuda:1"))
    assert ops.devices_set == []  # the consumer's own thread keeps its device


@pytest.mark.timeout(20)
def test_a_failing_set_device_reaches_the_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(FakeOps):
        def set_device(self, device: torch.device) -> None:
            raise RuntimeError("invalid device ordinal")

    use_fake_cuda(monkeypatch, Broken())
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        list(Fetcher([torch.ones(1)], prefetch_batches=2, device="cuda:7"))


# -- 2. "cuda" means the current device when the epoch starts --------------------


@pytest.mark.timeout(20)
def test_cuda_without_index_is_resolved_at_iter(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = FakeOps()
    use_fake_cuda(monkeypatch, ops)
    current = {"index": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    fetcher = Fetcher([torch.ones(1)], prefetch_batches=1, device="cuda")  # before set_device
    current["index"] = 2  # torch.cuda.set_device(local_rank)
    list(fetcher)
    assert {entry[4] for entry in copies(ops)} == {"cuda:2"}
    assert ops.devices_set == [(THREAD_NAME, torch.device("cuda", 2))]
    current["index"] = 3
    list(fetcher)  # each epoch resolves again
    assert copies(ops)[-1][4] == "cuda:3"


def test_make_transfer_leaves_the_index_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_current_device() -> int:
        raise AssertionError("resolved at construction")

    monkeypatch.setattr(torch.cuda, "current_device", no_current_device)
    transfer = make_transfer("cuda", pin_memory=None, non_blocking=True)
    assert transfer.device == torch.device("cuda") and transfer.pin_memory
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert transfer.bind().device == torch.device("cuda", 5)
    assert make_transfer("cuda:1", pin_memory=None, non_blocking=True).bind().device == (
        torch.device("cuda", 1)
    )


# -- 3. a source that recycles pinned buffers -----------------------------------


class RecyclingSource:
    """Yields one of two pinned (per ``ops``) buffers, refilled in place for each batch,
    and logs each ``next()`` into ``ops.log``."""

    def __init__(self, ops: FakeOps, n: int) -> None:
        self.ops, self.n = ops, n
        self.ring = [torch.zeros(2), torch.zeros(2)]
        ops.pinned.update(id(buf) for buf in self.ring)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.n):
            self.ops._note("next", i)
            buf = self.ring[i % 2]
            buf.fill_(float(i))
            yield buf


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_a_pinned_source_buffer_is_read_before_the_next_batch(
    prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = FakeOps()
    use_fake_cuda(monkeypatch, ops)
    received = [b.tolist() for b in Fetcher(RecyclingSource(ops, 5), prefetch, device="cuda:0")]
    assert received == [[float(i)] * 2 for i in range(5)]
    log = [e for e in ops.log if e[0] in ("next", "record", "synchronize", "pin")]
    assert not [e for e in log if e[0] == "pin"], "an already pinned tensor is not pinned again"
    for i in range(5):
        nxt = log.index(("next", i))
        record = next(e for e in log[nxt:] if e[0] == "record")
        sync = log.index(("synchronize", record[2]))
        later = [e for e in log[nxt + 1 :] if e[0] == "next"]
        if later:  # this batch's copy had finished before the source was asked again
            assert sync < log.index(later[0])


@pytest.mark.timeout(20)
def test_a_pageable_source_is_not_waited_on(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = FakeOps()
    use_fake_cuda(monkeypatch, ops)
    list(Fetcher([torch.ones(2) for _ in range(3)], prefetch_batches=2, device="cuda:0"))
    assert not [e for e in ops.log if e[0] == "synchronize"]


# -- 4. other accelerators --------------------------------------------------------


class Movable:
    """An object with its own ``.to()``, recording the thread and arguments of each call."""

    def __init__(self, on: str = "cpu") -> None:
        self.on = on
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def to(self, device: Any, **kwargs: Any) -> Movable:
        self.calls.append((threading.current_thread().name, device, kwargs))
        moved = Movable(str(device))
        moved.calls = self.calls
        return moved


@pytest.mark.timeout(20)
def test_non_cuda_devices_are_moved_on_the_consumer_thread() -> None:
    obj = Movable()
    batches = [{"x": torch.ones(2), "obj": obj}]
    (out,) = list(Fetcher(batches, prefetch_batches=2, device="meta"))
    assert out["x"].device.type == "meta" and out["obj"].on == "meta"
    assert obj.calls == [
        (threading.current_thread().name, torch.device("meta"), {"non_blocking": False})
    ]


def test_pin_memory_off_cuda_warns_once_at_construction() -> None:
    with pytest.warns(UserWarning, match="no effect") as record:
        fetcher = Fetcher([torch.ones(1)], device="meta", pin_memory=True)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(fetcher)  # nothing more per batch
        Fetcher([torch.ones(1)], device="meta")  # the default does not warn
    assert not DeviceTransfer("meta", pin_memory=True).pin_memory


# -- 5. costs on the producer thread -----------------------------------------------


@pytest.mark.timeout(20)
def test_producer_runs_one_intra_op_thread_and_leaves_the_callers_alone() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []

    def source() -> Iterator[int]:
        for i in range(3):
            seen.append(torch.get_num_threads())
            yield i

    if before == 1:
        torch.set_num_threads(2)
    try:
        main = torch.get_num_threads()
        assert list(Fetcher(source(), prefetch_batches=2)) == [0, 1, 2]
        assert seen == [1, 1, 1]
        assert torch.get_num_threads() == main
    finally:
        torch.set_num_threads(before)


def test_pinning_makes_contiguous_and_one_event_per_batch() -> None:
    ops = FakeOps()
    transfer = DeviceTransfer("cuda:0", ops=ops)
    strided = torch.arange(6.0).reshape(2, 3).t()
    assert not strided.is_contiguous()
    transfer.send({"a": strided, "b": [torch.ones(1), torch.zeros(1)], "c": torch.ones(2)})
    pins = [e for e in ops.log if e[0] == "pin"]
    assert len(pins) == 4 and all(contiguous for _, _, contiguous in pins)
    assert len([e for e in ops.log if e[0] == "record"]) == 1
    assert all(pinned for _, _, pinned, *_ in copies(ops))


# -- 6. containers -------------------------------------------------------------------


class TaggedDict(dict[str, Any]):
    def __init__(self, *args: Any, tag: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


class TaggedList(list[Any]):
    tag = ""


class FrozenMapping(Mapping[str, Any]):
    """A read-only mapping whose constructor takes no dict."""

    def __init__(self, **items: Any) -> None:
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclasses.dataclass(frozen=True)
class Sample:
    image: torch.Tensor
    label: int
    extra: list[torch.Tensor] = dataclasses.field(default_factory=list)
    size: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", self.image.numel())


Pair = namedtuple("Pair", ["x", "tag"])


def test_containers_keep_their_type_and_state() -> None:
    tagged = TaggedDict(x=torch.ones(1), tag="kept")
    tagged_list = TaggedList([torch.ones(1), "s"])
    tagged_list.tag = "kept"
    counts: defaultdict[str, Any] = defaultdict(list, x=torch.ones(1))
    tree = {
        "tagged": tagged,
        "list": tagged_list,
        "default": counts,
        "ordered": OrderedDict(b=torch.ones(1), a=torch.ones(1)),
        "frozen": FrozenMapping(x=torch.ones(1)),
        "pair": Pair(torch.ones(1), "t"),
        "sample": Sample(torch.ones(3), 4, [torch.ones(1)]),
    }
    out = map_tensors(lambda t: t + 1, tree)
    assert isinstance(out["tagged"], TaggedDict) and out["tagged"].tag == "kept"
    assert out["tagged"] is not tagged and tagged["x"].item() == 1.0  # input untouched
    assert isinstance(out["list"], TaggedList) and out["list"].tag == "kept"
    assert out["list"][1] == "s" and out["list"][0].item() == 2.0
    assert out["default"].default_factory is list and out["default"]["x"].item() == 2.0
    assert list(out["ordered"]) == ["b", "a"]
    assert out["frozen"] == {"x": torch.full((1,), 2.0)}  # cannot be rebuilt: a dict
    assert isinstance(out["pair"], Pair) and out["pair"].tag == "t"
    sample = out["sample"]
    assert isinstance(sample, Sample) and sample.label == 4 and sample.size == 3
    assert sample.image.tolist() == [2.0] * 3 and sample.extra[0].item() == 2.0
    assert len(list(iter_tensors(tree))) == 9


def test_a_shared_tensor_is_mapped_once() -> None:
    shared = torch.ones(2)
    calls: list[torch.Tensor] = []

    def fn(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor)
        return tensor + 1

    out = map_tensors(fn, {"a": shared, "b": [shared, (shared,)], "c": torch.ones(1)})
    assert len(calls) == 2
    assert out["a"] is out["b"][0] is out["b"][1][0]
    assert len(list(iter_tensors({"a": shared, "b": [shared]}))) == 1


def test_objects_with_to_are_moved_on_the_consumer_thread_for_cuda() -> None:
    ops = FakeOps()
    transfer = DeviceTransfer("cuda:0", ops=ops)
    obj = Movable()
    inflight = transfer.send({"x": torch.ones(1), "obj": obj})
    assert inflight.pending and not obj.calls  # not on the producer thread
    out = transfer.receive(inflight)
    assert out["obj"].on == "cuda:0"
    assert obj.calls == [
        (threading.current_thread().name, torch.device("cuda", 0), {"non_blocking": True})
    ]
    waits = [i for i, e in enumerate(ops.log) if e[0] == "wait"]
    assert waits  # after the wait on the batch's event


def test_a_to_without_non_blocking_is_called_plainly() -> None:
    class Plain:
        def to(self, device: Any) -> str:
            return f"on {device}"

    transfer = DeviceTransfer("cuda:0", ops=FakeOps())
    assert transfer.receive(transfer.send([Plain()])) == ["on cuda:0"]


@pytest.mark.timeout(20)
def test_shared_tensor_in_a_batch_is_copied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = FakeOps()
    use_fake_cuda(monkeypatch, ops)
    shared = torch.ones(2)
    (out,) = list(Fetcher([{"a": shared, "b": shared}], prefetch_batches=1, device="cuda:0"))
    assert len(copies(ops)) == 1 and out["a"] is out["b"]
    assert len([e for e in ops.log if e[0] == "record_stream"]) == 1


# -- the GPU check script ---------------------------------------------------------------


def test_gpu_check_script_imports_and_skips_without_cuda() -> None:
    spec = importlib.util.spec_from_file_location("fetcher_check", GPU_CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing runs nothing
    assert callable(module.main) and module.CHECKS
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: run the script by hand")
    done = subprocess.run(
        [sys.executable, str(GPU_CHECK)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stdout
    assert not fetcher_threads()
