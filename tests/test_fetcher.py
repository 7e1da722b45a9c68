"""Tests of the Fetcher: look-ahead, background thread, resume state, device hand-over."""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asynccache.torch.fetcher as fetcher_module
from asynccache.errors import ConfigError, ResumeStateError
from asynccache.testing.resume import assert_resumes_exactly
from asynccache.torch._device import DeviceTransfer, InFlight, iter_tensors, map_tensors
from asynccache.torch.fetcher import Fetcher, FetcherStats

THREAD_NAME = "asynccache-fetcher"
PREFETCH = [0, 1, 2, 4]


def fetcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Returns once ``condition()`` holds; fails the test if it doesn't within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.005)
    if not condition():
        raise AssertionError(f"still waiting after {timeout_s} s: {what or condition}")


def test_wait_until_fails_when_the_condition_never_holds() -> None:
    with pytest.raises(AssertionError, match="still waiting"):
        wait_until(lambda: False, timeout_s=0.05)
    wait_until(lambda: True, timeout_s=0.05)


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    baseline = threading.active_count()
    yield
    wait_until(lambda: not fetcher_threads(), what="a fetcher thread outlived its test")
    wait_until(lambda: threading.active_count() <= baseline, what="threads left behind")


class CountingSource:
    """Iterable over range(n); its state is how many items it has produced so far.

    Like a stateful data loader, ``iter()`` starts a fresh epoch, from the loaded
    state if there is one.
    """

    def __init__(self, n: int, delay_s: float = 0.0, tensors: bool = False) -> None:
        self.n = n
        self.delay_s = delay_s
        self.tensors = tensors
        self.produced = 0
        self._resume_at: int | None = None

    def __iter__(self) -> Iterator[Any]:
        self.produced = self._resume_at or 0
        self._resume_at = None
        return self._items()

    def _items(self) -> Iterator[Any]:
        while self.produced < self.n:
            value = self.produced
            if self.delay_s:
                time.sleep(self.delay_s)
            self.produced += 1
            yield {"x": torch.full((2,), value), "i": value} if self.tensors else value

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"produced": self.produced}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = state["produced"]


def unsized(n: int) -> Iterator[int]:
    yield from range(n)


def failing_source(good: int) -> Iterator[int]:
    yield from range(good)
    raise ValueError("the source broke")


def endless(delay_s: float) -> Iterator[int]:
    i = 0
    while True:
        time.sleep(delay_s)
        yield i
        i += 1


# -- done, fetched, len ---------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", PREFETCH)
@pytest.mark.parametrize("n", [0, 1, 2, 5])
@pytest.mark.parametrize("sized", [True, False])
def test_done_is_known_one_ahead(prefetch: int, n: int, sized: bool) -> None:
    source: Any = list(range(n)) if sized else unsized(n)
    fetcher = Fetcher(source, prefetch_batches=prefetch)
    assert not fetcher.done
    seen = [(batch, fetcher.done, fetcher.fetched) for batch in fetcher]
    assert seen == [(i, i == n - 1, i + 1) for i in range(n)]
    assert fetcher.fetched == n
    if sized:
        assert len(fetcher) == n
    else:
        with pytest.raises(TypeError):
            len(fetcher)


@pytest.mark.timeout(60)
@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 12), prefetch=st.integers(0, 5), stop=st.integers(0, 12))
def test_any_stop_point_resumes_with_the_rest(n: int, prefetch: int, stop: int) -> None:
    stop = min(stop, n)
    source = CountingSource(n)
    with Fetcher(source, prefetch_batches=prefetch) as fetcher:
        it = iter(fetcher)
        before = [next(it) for _ in range(stop)]
        assert fetcher.done == (stop == n and n > 0)
        state = fetcher.state_dict()
    fetcher = Fetcher(CountingSource(n), prefetch_batches=prefetch)
    fetcher.load_state_dict(state)
    assert before + list(fetcher) == list(range(n))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_each_iter_starts_a_fresh_epoch(prefetch: int) -> None:
    source = CountingSource(4)
    fetcher = Fetcher(source, prefetch_batches=prefetch)
    assert list(fetcher) == [0, 1, 2, 3]
    it = iter(fetcher)
    assert next(it) == 0
    assert (fetcher.fetched, fetcher.done) == (1, False)
    assert list(fetcher) == [0, 1, 2, 3]  # restarting mid-epoch drops the old epoch
    assert fetcher.done and fetcher.fetched == 4


@pytest.mark.timeout(20)
def test_threads_return_to_baseline_across_epochs() -> None:
    baseline = threading.active_count()
    fetcher = Fetcher(CountingSource(6), prefetch_batches=2)
    for epoch in range(5):
        for i, _ in enumerate(fetcher):
            if epoch % 2 and i == 2:
                break  # an abandoned epoch is stopped by the next iter()
        if not epoch % 2:  # a finished epoch joins its thread when done turns true
            assert threading.active_count() == baseline
    fetcher.close()
    assert threading.active_count() == baseline
    assert not fetcher_threads()


# -- the background thread ------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_source_error_reaches_consumer_with_its_traceback(prefetch: int) -> None:
    fetcher = Fetcher(failing_source(3), prefetch_batches=prefetch)
    received = []
    with pytest.raises(ValueError, match="the source broke") as info:
        for batch in fetcher:
            received.append((batch, fetcher.done))
    assert received == [(0, False), (1, False), (2, False)]
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_source" in frames
    assert list(fetcher) == []  # the generator is spent; the fetcher is still usable


@pytest.mark.timeout(20)
def test_a_failing_device_copy_reaches_the_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    class BrokenOps(FakeOps):
        def copy(self, tensor: torch.Tensor, device: Any, **flags: bool) -> torch.Tensor:
            raise RuntimeError("copy failed")

    monkeypatch.setattr(
        fetcher_module, "make_transfer", lambda d, **kw: DeviceTransfer(d, ops=BrokenOps())
    )
    with pytest.raises(RuntimeError, match="copy failed"):
        list(Fetcher([torch.ones(1)], prefetch_batches=2, device="cuda:0"))


@pytest.mark.timeout(20)
def test_producer_thread_is_named_daemon() -> None:
    with Fetcher(endless(0.001), prefetch_batches=2) as fetcher:
        next(iter(fetcher))
        (thread,) = fetcher_threads()
        assert thread.daemon


@pytest.mark.timeout(20)
@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_close_mid_epoch_is_prompt(delay_s: float) -> None:
    # delay 0: the thread is parked on a full queue; 0.05: it is inside the source.
    fetcher = Fetcher(endless(delay_s), prefetch_batches=2)
    it = iter(fetcher)
    assert [next(it), next(it)] == [0, 1]
    fetcher.close()  # the per-test timeout bounds it; the thread must be gone when it returns
    assert not fetcher_threads()
    with pytest.raises(StopIteration):
        next(it)


class ClosableSource:
    """Each ``iter()`` gives an iterator over 0, 1, ... with ``close()``, like a stateful
    loader's epoch: it counts what it hands out, and nothing once closed. Item
    ``stall_at`` blocks until ``release`` is set."""

    def __init__(self, stall_at: int) -> None:
        self.stall_at = stall_at
        self.entered, self.release = threading.Event(), threading.Event()
        self.counted = 0
        self.closes = 0

    def __iter__(self) -> Iterator[int]:
        source = self

        class It:
            close_is_thread_safe = True  # a flag write, like CacheDataLoader's epochs
            closed = False
            n = 0

            def __iter__(self) -> It:
                return self

            def __next__(self) -> int:
                if self.closed:
                    raise StopIteration
                i, self.n = self.n, self.n + 1
                if i == source.stall_at:
                    source.entered.set()
                    source.release.wait(10)  # bounded, so the test cannot hang
                if self.closed:  # it was closed while this batch was being made
                    raise StopIteration
                source.counted += 1
                return i

            def close(self) -> None:
                self.closed = True
                source.closes += 1

        return It()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_close_closes_the_source_iterator(prefetch: int) -> None:
    source = ClosableSource(stall_at=-1)
    with Fetcher(source, prefetch_batches=prefetch) as fetcher:
        assert next(iter(fetcher)) == 0
    assert source.closes >= 1


@pytest.mark.timeout(20)
def test_a_stuck_producer_returning_after_close_is_not_counted() -> None:
    source = ClosableSource(stall_at=2)
    fetcher = Fetcher(source, prefetch_batches=1, close_timeout_s=0.1)
    it = iter(fetcher)
    assert next(it) == 0
    assert source.entered.wait(10)
    counted = source.counted  # 0 and 1: the thread is inside item 2
    fetcher.close()
    assert source.closes >= 1, "the iterator learns at close() that nobody takes more"
    source.release.set()
    wait_until(lambda: not fetcher_threads(), what="the fetcher thread to exit")
    assert source.counted == counted == 2


@pytest.mark.timeout(20)
def test_context_manager_stops_the_thread() -> None:
    with Fetcher(endless(0.0), prefetch_batches=4) as fetcher:
        for batch in fetcher:
            if batch == 3:
                break
        assert fetcher_threads()
    assert not fetcher_threads()


@pytest.mark.timeout(20)
def test_close_gives_up_on_a_stuck_source_after_its_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release, entered, returned = threading.Event(), threading.Event(), threading.Event()

    def stuck() -> Iterator[int]:
        yield 0
        entered.set()
        release.wait(10)  # bounded, so the test cannot hang
        returned.set()
        yield 1

    fetcher = Fetcher(stuck(), prefetch_batches=2, close_timeout_s=0.1)
    it = iter(fetcher)
    assert entered.wait(5)
    with caplog.at_level(logging.WARNING, logger="asynccache.fetcher"):
        fetcher.close()
    # close() gave up on the source instead of waiting for it: the source is still stuck.
    assert not returned.is_set()
    assert "still inside the source" in caplog.text
    release.set()  # the source returns; the thread sees the stop flag and exits
    wait_until(lambda: not fetcher_threads(), what="the fetcher thread to exit")
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.timeout(20)
def test_a_dropped_fetcher_stops_its_thread() -> None:
    fetcher = Fetcher(endless(0.0), prefetch_batches=2)
    next(iter(fetcher))
    assert fetcher_threads()
    del fetcher
    gc.collect()
    wait_until(lambda: not fetcher_threads(), what="the fetcher thread to exit")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_back_pressure_bounds_the_run_ahead(prefetch: int) -> None:
    source = CountingSource(100)
    with Fetcher(source, prefetch_batches=prefetch) as fetcher:
        it = iter(fetcher)
        for consumed in (0, 3):
            for _ in range(consumed):
                next(it)
            limit = fetcher.fetched + prefetch + 1  # queued + the one being produced

            def reached(limit: int = limit) -> bool:
                return source.produced == limit

            wait_until(reached, what=f"{limit} batches produced")
            time.sleep(0.1)
            assert source.produced == limit


# -- resume state ---------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_state_is_never_ahead_of_the_consumer(prefetch: int) -> None:
    source = CountingSource(20)
    with Fetcher(source, prefetch_batches=prefetch) as fetcher:
        assert fetcher.state_dict() == {"produced": 0}
        it = iter(fetcher)
        assert fetcher.state_dict() == {"produced": 0}
        for k in range(1, 8):
            assert next(it) == k - 1
            ahead = k + prefetch

            def ran_ahead(ahead: int = ahead) -> bool:
                return source.produced >= ahead

            wait_until(ran_ahead, what="the thread to run ahead")
            assert fetcher.state_dict() == {"produced": k}
        assert source.produced > 7 or prefetch == 0


@pytest.mark.timeout(20)
def test_state_dict_is_a_snapshot() -> None:
    with Fetcher(CountingSource(5), prefetch_batches=2) as fetcher:
        it = iter(fetcher)
        next(it)
        state = fetcher.state_dict()
        state["produced"] = 99
        assert fetcher.state_dict() == {"produced": 1}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_resume_conformance(prefetch: int) -> None:
    assert_resumes_exactly(lambda: CountingSource(9), [0, 1, 4, 8, 9], prefetch_batches=prefetch)
    assert_resumes_exactly(lambda: CountingSource(5, tensors=True), [0, 2, 5])


@pytest.mark.timeout(20)
def test_resume_conformance_catches_a_source_that_forgets() -> None:
    class Forgetful(CountingSource):
        def load_state_dict(self, state: dict[str, int]) -> None:
            pass  # resumes from the start

    with pytest.raises(AssertionError, match="resuming after 3 items"):
        assert_resumes_exactly(lambda: Forgetful(6), [3])
    with pytest.raises(ValueError, match="outside"):
        assert_resumes_exactly(lambda: CountingSource(2), [3])


@pytest.mark.timeout(20)
def test_load_state_dict_stops_the_epoch_and_resumes() -> None:
    fetcher = Fetcher(CountingSource(6), prefetch_batches=2)
    it = iter(fetcher)
    next(it)
    fetcher.load_state_dict({"produced": 4})
    assert not fetcher_threads()
    assert fetcher.fetched == 0
    assert list(fetcher) == [4, 5]


@pytest.mark.timeout(20)
def test_stateless_source() -> None:
    fetcher = Fetcher([1, 2], prefetch_batches=1)
    assert fetcher.state_dict() == {}
    fetcher.load_state_dict({})
    with pytest.raises(ResumeStateError):
        fetcher.load_state_dict({"produced": 1})


# -- what the step receives -----------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_transform_runs_on_the_consumer_thread(prefetch: int) -> None:
    threads = set()

    def double(batch: int) -> int:
        threads.add(threading.current_thread().name)
        return batch * 2

    fetcher = Fetcher(range(4), prefetch_batches=prefetch, transform=double)
    assert list(fetcher) == [0, 2, 4, 6]
    assert threads == {threading.current_thread().name}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_iterator_mode_hands_the_step_the_iterator(prefetch: int) -> None:
    fetcher = Fetcher(range(5), prefetch_batches=prefetch, yield_iterator=True)
    steps = []
    for batches in fetcher:
        assert batches is fetcher
        pulled = [next(batches)]
        if not batches.done:
            pulled.append(next(batches))
        steps.append(pulled)
    assert steps == [[0, 1], [2, 3], [4]]
    assert fetcher.done and fetcher.fetched == 5
    assert list(Fetcher([], prefetch_batches=prefetch, yield_iterator=True)) == []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_device_is_a_no_op(device: Any) -> None:
    batches = [{"x": torch.ones(2)}, (torch.zeros(1), "label")]
    received = list(Fetcher(batches, prefetch_batches=1, device=device))
    assert all(got is sent for got, sent in zip(received, batches, strict=True))


# -- stats ----------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_stats_see_a_slow_source() -> None:
    fetcher = Fetcher(CountingSource(6, delay_s=0.03), prefetch_batches=2)
    assert fetcher.stats == FetcherStats()
    for _ in fetcher:
        pass  # the step is instant: the consumer mostly waits
    stats = fetcher.stats
    assert stats.steps == 6
    assert stats.stall_pct > 50
    assert 0 < stats.wait_s <= stats.wall_s
    assert "stall_pct=" in repr(stats)


@pytest.mark.timeout(20)
def test_stats_see_a_slow_step() -> None:
    fetcher = Fetcher(range(6), prefetch_batches=2)
    for _ in fetcher:
        time.sleep(0.03)  # the source is instant: the consumer mostly computes
    assert fetcher.stats.stall_pct < 50
    assert fetcher.stats.wall_s >= 6 * 0.03


@pytest.mark.timeout(20)
def test_stats_are_logged_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="asynccache.fetcher"):
        list(Fetcher(range(7), prefetch_batches=1, log_every=3))
    records = [r for r in caplog.records if r.name == "asynccache.fetcher"]
    assert len(records) == 2
    assert "steps=3" in records[0].getMessage()


@pytest.mark.timeout(20)
def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        Fetcher([], prefetch_batches=-1)
    with pytest.raises(ConfigError):
        Fetcher([], log_every=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            Fetcher([], device="cuda")


# -- the device hand-over, with fake streams ------------------------------------

Pair = namedtuple("Pair", ["image", "label"])


def test_map_tensors_keeps_the_structure() -> None:
    tree: dict[str, Any] = {
        "pair": Pair(torch.ones(1), 3),
        "list": [torch.zeros(2), "text", (torch.ones(3),)],
        "ordered": OrderedDict(a=torch.ones(1)),
    }
    mapped = map_tensors(lambda t: t + 1, tree)
    assert isinstance(mapped["pair"], Pair) and mapped["pair"].label == 3
    assert torch.equal(mapped["pair"].image, torch.full((1,), 2.0))
    assert mapped["list"][1] == "text" and isinstance(mapped["list"][2], tuple)
    assert isinstance(mapped["ordered"], OrderedDict)
    assert torch.equal(tree["pair"].image, torch.ones(1))  # input untouched
    assert len(list(iter_tensors(tree))) == 4


class FakeOps:
    """Stream primitives that log what a CUDA run would do, in order.

    ``pinned`` holds the ids of host tensors that count as page-locked; ``pin`` adds
    the copy it returns.
    """

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.streams = 0
        self.pinned: set[int] = set()
        self.devices_set: list[tuple[str, Any]] = []  # (thread name, device)

    def _note(self, *entry: Any) -> None:
        with self.lock:
            self.log.append(entry)

    def set_device(self, device: torch.device) -> None:
        self.devices_set.append((threading.current_thread().name, device))

    def new_stream(self, device: torch.device) -> str:
        self.streams += 1
        return f"side{self.streams}"

    @contextmanager
    def use(self, stream: str) -> Iterator[None]:
        self._note("enter", stream)
        yield
        self._note("exit", stream)

    def current_stream(self, device: torch.device) -> str:
        return "consumer"

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.pinned

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.clone()
        self.pinned.add(id(pinned))
        self._note("pin", tensor.tolist(), tensor.is_contiguous())
        return pinned

    def copy(self, tensor: torch.Tensor, device: torch.device, *, non_blocking: bool) -> Any:
        self._note("copy", tensor.tolist(), self.is_pinned(tensor), non_blocking, str(device))
        return tensor.clone()

    def record_event(self, stream: str) -> tuple[str, int]:
        event = ("event", len(self.log))
        self._note("record", stream, event)
        return event

    def wait_event(self, stream: str, event: Any) -> None:
        self._note("wait", stream, event)

    def synchronize_event(self, event: Any) -> None:
        self._note("synchronize", event)

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self._note("record_stream", tensor.tolist(), stream)


def test_transfer_orders_copies_event_and_wait() -> None:
    ops = FakeOps()
    transfer = DeviceTransfer("cuda:0", ops=ops)
    batch = {"a": torch.tensor([1.0]), "b": [torch.tensor([2.0]), "keep"]}
    inflight = transfer.send(batch)
    assert ops.log == [
        ("enter", "side1"),
        ("pin", [1.0], True),
        ("copy", [1.0], True, True, "cuda:0"),
        ("pin", [2.0], True),
        ("copy", [2.0], True, True, "cuda:0"),
        ("record", "side1", ("event", 5)),
        ("exit", "side1"),
    ]
    assert inflight.event == ("event", 5)
    ops.log.clear()
    received = transfer.receive(inflight)
    assert ops.log == [
        ("wait", "consumer", ("event", 5)),
        ("record_stream", [1.0], "consumer"),
        ("record_stream", [2.0], "consumer"),
    ]
    assert received["b"][1] == "keep" and received["a"] is not batch["a"]
    transfer.send(batch)
    assert ops.streams == 1  # one side stream, reused


def test_transfer_flags_and_no_op_paths() -> None:
    ops = FakeOps()
    DeviceTransfer("cuda:0", pin_memory=False, non_blocking=False, ops=ops).send(torch.ones(1))
    assert ("copy", [1.0], False, False, "cuda:0") in ops.log
    cpu = DeviceTransfer("cpu")
    assert cpu.is_noop
    batch = [torch.ones(1)]
    assert cpu.receive(cpu.send(batch)) is batch
    meta = DeviceTransfer("meta")  # not CUDA: a plain copy, in receive()
    inflight = meta.send(batch)
    assert inflight.batch is batch and inflight.pending
    assert meta.receive(inflight)[0].device.type == "meta"
    assert DeviceTransfer(None).receive(InFlight(batch)) is batch


@pytest.mark.timeout(20)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_fetcher_copies_in_the_producer_and_waits_in_the_consumer(
    prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = FakeOps()
    copy_threads: set[str] = set()
    original_copy = ops.copy

    def copy(tensor: torch.Tensor, device: Any, **flags: bool) -> torch.Tensor:
        copy_threads.add(threading.current_thread().name)
        return original_copy(tensor, device, **flags)

    ops.copy = copy  # type: ignore[method-assign]
    monkeypatch.setattr(
        fetcher_module, "make_transfer", lambda device, **kw: DeviceTransfer(device, ops=ops)
    )
    seen_waits: list[int] = []

    def transform(batch: torch.Tensor) -> torch.Tensor:
        waits = [entry for entry in ops.log if entry[0] == "wait"]
        seen_waits.append(len(waits))  # this batch's wait already happened
        return batch

    batches = [torch.tensor([float(i)]) for i in range(3)]
    fetcher = Fetcher(batches, prefetch_batches=prefetch, device="cuda:0", transform=transform)
    received = list(fetcher)
    assert [b.item() for b in received] == [0.0, 1.0, 2.0]
    assert seen_waits == [1, 2, 3]
    expected = {threading.current_thread().name} if prefetch == 0 else {THREAD_NAME}
    assert copy_threads == expected
    recorded = [entry[2] for entry in ops.log if entry[0] == "record"]
    waited = [entry[2] for entry in ops.log if entry[0] == "wait"]
    assert waited == recorded  # each batch's wait names the event recorded after its copy


@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_end_to_end() -> None:
    Batch = namedtuple("Batch", ["x", "y"])
    batches = [Batch(torch.full((256, 256), float(i)), {"y": torch.tensor([i])}) for i in range(8)]
    fetcher = Fetcher(batches, prefetch_batches=2, device="cuda")
    total = 0.0
    for batch in fetcher:
        assert batch.x.is_cuda and batch.y["y"].is_cuda and isinstance(batch, Batch)
        total += float((batch.x * 2).mean())
    torch.cuda.synchronize()
    assert total == 2 * sum(range(8))


@pytest.mark.timeout(20)
def test_close_never_touches_a_generator_the_producer_is_inside() -> None:
    # Closing a running generator from another thread can corrupt it in CPython: close()
    # must leave it to the producer thread (or the collector) while the thread is inside.
    release, entered = threading.Event(), threading.Event()
    closed_inside: list[bool] = []

    def stuck() -> Iterator[int]:
        try:
            yield 0
            entered.set()
            release.wait(10)  # bounded, so the test cannot hang
            yield 1
        except GeneratorExit:
            closed_inside.append(True)
            raise

    gen = stuck()
    fetcher = Fetcher(gen, prefetch_batches=2, close_timeout_s=0.1)
    it = iter(fetcher)
    assert entered.wait(5)
    fetcher.close()
    assert gen.gi_running  # still inside, untouched
    release.set()
    wait_until(lambda: not fetcher_threads(), what="the fetcher thread to exit")
    assert not closed_inside  # nobody threw GeneratorExit into the running frame
    with pytest.raises(StopIteration):
        next(it)
