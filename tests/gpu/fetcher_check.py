"""GPU checks for the Fetcher's CUDA copy path; run by hand on a CUDA machine:

    python tests/gpu/fetcher_check.py          # about a minute on one GPU

Each race check runs the real code, which must come out clean, and a mutant with
one guard removed, which must be caught: that proves the check can see the bug it
is about. Without CUDA the script prints that it skipped and exits 0 (pytest does
not collect this file; tests/test_fetcher_device.py imports it and runs the skip).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from asynccache.torch._device import CudaStreamOps
from asynccache.torch.fetcher import Fetcher

N, NUMEL = 24, 1 << 20  # 24 batches of 4 MiB
ORIGINAL_COPY = CudaStreamOps.copy
ORIGINAL_PIN = CudaStreamOps.pin
_cycles_per_ms = 0.0


def gpu_sleep(ms: float) -> None:
    """Queues about ``ms`` of busy-waiting on the current stream."""
    torch.cuda._sleep(int(ms * _cycles_per_ms))


def calibrate() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def no_op(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def patched(**attrs: Any) -> Iterator[None]:
    old = {name: getattr(CudaStreamOps, name) for name in attrs}
    for name, value in attrs.items():
        setattr(CudaStreamOps, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(CudaStreamOps, name, value)


def delayed(ms: float) -> Callable[..., Any]:
    """A copy that the side stream starts ``ms`` late (we are inside its context)."""

    def copy(self: CudaStreamOps, tensor: torch.Tensor, device: Any, *, non_blocking: bool) -> Any:
        gpu_sleep(ms)
        return ORIGINAL_COPY(self, tensor, device, non_blocking=non_blocking)

    return copy


_staging: dict[Any, torch.Tensor] = {}


def staging_pin(self: CudaStreamOps, tensor: torch.Tensor) -> torch.Tensor:
    """Mutant: one reused pinned buffer per shape, refilled while its DMA may be queued."""
    key = (tensor.shape, tensor.dtype)
    if key not in _staging:
        _staging[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    buf = _staging[key]
    buf.copy_(tensor)
    return buf


def fresh(n: int = N, pause: float = 0.0) -> Iterator[torch.Tensor]:
    """A new pageable tensor per batch, filled with i + 1."""
    for i in range(n):
        time.sleep(pause)
        yield torch.full((NUMEL,), float(i + 1))


def pinned_ring(n: int = N) -> Iterator[torch.Tensor]:
    """A source that recycles two pinned buffers."""
    ring = [torch.empty(NUMEL, pin_memory=True) for _ in range(2)]
    for i in range(n):
        ring[i % 2].fill_(float(i + 1))
        yield ring[i % 2]


def run(make_source: Callable[[], Any], consumer_ms: float = 0, prefetch: int = 3) -> list[int]:
    """Consumes on a non-default stream; returns the indices of batches with wrong values."""
    compute, rows = torch.cuda.Stream(), []
    fetcher = Fetcher(make_source(), prefetch_batches=prefetch, device="cuda")
    # Iterate inside the step's stream context, so the wait and record_stream target it.
    with torch.cuda.stream(compute), fetcher:
        for batch in fetcher:
            if consumer_ms:
                gpu_sleep(consumer_ms)  # the step reads the batch late
            rows.append(torch.stack(torch.aminmax(batch)))
            del batch  # its memory is up for reuse at once
    torch.cuda.synchronize()
    values = torch.stack(rows).tolist()
    return [i for i, (lo, hi) in enumerate(values) if not lo == hi == i + 1]


def race(
    name: str, fn: Callable[[], list[int]], base: dict[str, Any], mutant: dict[str, Any]
) -> bool:
    with patched(**base):
        bad = fn()
    with patched(**{**base, **mutant}):
        caught = fn()
    verdict = "caught" if caught else "NOT CAUGHT: the check is too weak"
    print(f"{name}: real bad={bad} | mutant bad={caught[:5]} -> {verdict}")
    return not bad and bool(caught)


def check_wait() -> bool:  # the step's stream must wait for the copy (copies land late)
    return race("A wait_event", lambda: run(fresh), {"copy": delayed(30)}, {"wait_event": no_op})


def check_record_stream() -> bool:  # the step reads late while the producer copies on
    return race(
        "B record_stream",
        lambda: run(lambda: fresh(pause=0.005), consumer_ms=50),
        {},
        {"record_stream": no_op},
    )


def check_staging() -> bool:  # our pinned buffer must outlive its queued DMA
    return race("C staging buffer", lambda: run(fresh), {"copy": delayed(20)}, {"pin": staging_pin})


def check_pinned_source() -> bool:  # a source's recycled pinned buffer is read before reuse
    return race(
        "C' pinned source",
        lambda: run(pinned_ring),
        {"copy": delayed(20)},
        {"synchronize_event": no_op},
    )


Pair = namedtuple("Pair", "x tag")


@dataclass
class Sample:
    t: torch.Tensor


def check_structure() -> bool:
    on_dev = torch.ones(3, device="cuda")
    shared = torch.arange(2.0)
    batch = {
        "p": Pair(torch.arange(4.0), "s"),
        "l": [torch.zeros(2), 7, (torch.ones(1),)],
        "dev": on_dev,
        "dc": Sample(torch.ones(1)),
        "a": shared,
        "b": shared,
    }
    with Fetcher([batch], device="cuda") as fetcher:
        (out,) = list(fetcher)
    ok = (
        isinstance(out["p"], Pair)
        and out["p"].tag == "s"
        and out["l"][1] == 7
        and out["l"][2][0].is_cuda
        and out["dev"] is on_dev
        and out["dc"].t.is_cuda
        and out["a"] is out["b"]
        and torch.equal(out["p"].x.cpu(), torch.arange(4.0))
    )
    print("D structure ok:", ok)
    return ok


def check_close_and_errors() -> bool:
    with patched(copy=delayed(50)):
        fetcher = Fetcher(fresh(1000), prefetch_batches=4, device="cuda")
        first = next(iter(fetcher))
        fetcher.close()
        torch.cuda.synchronize()
        ok = torch.equal(first.cpu(), torch.full((NUMEL,), 1.0))

    def failing() -> Iterator[torch.Tensor]:
        yield from fresh(3)
        raise RuntimeError("boom")

    got, err = [], None
    try:
        for batch in Fetcher(failing(), device="cuda"):
            got.append(batch[0].item())
    except RuntimeError as exc:
        err = str(exc)
    ok = ok and got == [1.0, 2.0, 3.0] and err == "boom"
    print("E close/errors ok:", ok)
    return ok


MULTI_GPU = """import torch
from asynccache.torch.fetcher import Fetcher
fetcher = Fetcher([torch.ones(1 << 20) for _ in range(4)], device="cuda")  # before set_device
torch.cuda.set_device(1)
assert all(b.device.index == 1 for b in fetcher)
torch.cuda.synchronize()
print(int(torch._C._cuda_hasPrimaryContext(0)))"""


def check_no_context_on_gpu0() -> bool:
    if torch.cuda.device_count() < 2:
        print("F skipped: needs 2 GPUs")
        return True
    done = subprocess.run(
        [sys.executable, "-c", MULTI_GPU], capture_output=True, text=True, timeout=90
    )
    ctx0 = done.stdout.strip()[-1:] if done.returncode == 0 else done.stderr[-400:]
    print("F context on GPU 0 (want 0):", ctx0)
    return ctx0 == "0"


def report_overlap() -> bool:  # informational: 20 steps x 20 ms GPU work, 32 MiB batches
    big = [torch.full((8 << 20,), float(i)) for i in range(20)]
    compute = torch.cuda.Stream()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(compute), Fetcher(big, prefetch_batches=2, device="cuda") as fetcher:
        for batch in fetcher:
            gpu_sleep(20)
            batch.sum()
    torch.cuda.synchronize()
    print(f"G {time.perf_counter() - start:.2f}s (ideal about 0.40s) {fetcher.stats}")
    return True


CHECKS = [
    check_wait,
    check_record_stream,
    check_staging,
    check_pinned_source,
    check_structure,
    check_close_and_errors,
    check_no_context_on_gpu0,
    report_overlap,
]


def main() -> int:
    global _cycles_per_ms
    if not torch.cuda.is_available():
        print("skipped: CUDA is not available")
        return 0
    _cycles_per_ms = calibrate()
    failures = [check.__name__ for check in CHECKS if not check()]
    print("FAILED:" if failures else "ALL OK", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
