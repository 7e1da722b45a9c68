"""Moving batches to a device without making the training step wait for the copy.

A batch is any pytree of tensors: dicts (and other mappings), lists, tuples and
namedtuples, nested freely; every other leaf passes through untouched.

The copy is split in two halves so that it can run on another thread:

* :meth:`DeviceTransfer.send` runs on the producer thread. For CUDA it pins the
  host tensors (if asked), issues the copies on a side stream and records an event
  on that stream after the last copy.
* :meth:`DeviceTransfer.receive` runs on the consumer thread. It makes the
  consumer's current stream wait on that event, and marks every device tensor as
  used by the consumer's stream (``Tensor.record_stream``), so that the caching
  allocator does not hand its memory back to the side stream while the step still
  reads it.

Invariant: a batch returned by ``receive`` is safe to use on the consumer's current
stream; nothing on the host blocks on the copy.

The CUDA calls sit behind a small :class:`StreamOps` protocol, so the ordering logic
is testable on a machine without a GPU by passing a fake.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asynccache.errors import ConfigError

__all__ = [
    "CudaStreamOps",
    "DeviceTransfer",
    "InFlight",
    "StreamOps",
    "iter_tensors",
    "make_transfer",
    "map_tensors",
]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """Returns a copy of ``tree`` with ``fn`` applied to every tensor leaf.

    Containers are rebuilt with their own type (namedtuples keep their fields,
    ``OrderedDict`` stays ordered); the input is never mutated. A mapping whose type
    cannot be rebuilt from its items (e.g. ``defaultdict``) becomes a plain ``dict``.
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        items = {key: map_tensors(fn, value) for key, value in tree.items()}
        if type(tree) is dict:
            return items
        factory: Any = type(tree)
        try:
            return factory(items)
        except TypeError:
            return items
    if isinstance(tree, tuple):
        mapped = [map_tensors(fn, value) for value in tree]
        if hasattr(tree, "_fields"):  # namedtuple: positional constructor
            return type(tree)(*mapped)
        return tuple(mapped) if type(tree) is tuple else type(tree)(mapped)
    if isinstance(tree, list):
        return [map_tensors(fn, value) for value in tree]
    return tree


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Yields every tensor leaf of ``tree``, in the order :func:`map_tensors` visits them."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from iter_tensors(value)
    elif isinstance(tree, (tuple, list)):
        for value in tree:
            yield from iter_tensors(value)


class StreamOps(Protocol):
    """The stream, event and copy primitives a :class:`DeviceTransfer` uses."""

    def new_stream(self) -> Any:
        """Returns a fresh side stream for the copies."""

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        """Makes ``stream`` current for the enclosed block."""

    def current_stream(self) -> Any:
        """Returns the calling thread's current stream on the target device."""

    def copy(self, tensor: torch.Tensor, *, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
        """Copies one tensor to the target device on the current stream."""

    def record_event(self, stream: Any) -> Any:
        """Records and returns an event on ``stream`` after the work queued so far."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Makes future work on ``stream`` wait for ``event``; never blocks the host."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tells the allocator that ``tensor`` is used by ``stream``."""


class CudaStreamOps:
    """:class:`StreamOps` for one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def copy(self, tensor: torch.Tensor, *, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
        if pin_memory and tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=non_blocking)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)


@dataclass(frozen=True)
class InFlight:
    """A batch whose copy was issued by :meth:`DeviceTransfer.send`; ``event`` marks its end."""

    batch: Any
    event: Any = None


class DeviceTransfer:
    """Copies batches to a device on a side stream; see the module docstring.

    Args:
        device: The target device. ``None`` or a CPU device makes both halves no-ops
            that return the batch object itself.
        pin_memory: Pin host tensors before copying. ``None`` means "yes for CUDA".
        non_blocking: Issue the host-to-device copies asynchronously.
        ops: The stream primitives; defaults to :class:`CudaStreamOps` for CUDA
            devices. Tests pass a fake here.

    Non-CUDA accelerators (without ``ops``) get a plain blocking ``tensor.to(device)``
    on the producer thread.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        pin_memory: bool | None = None,
        non_blocking: bool = True,
        ops: StreamOps | None = None,
    ) -> None:
        self.device = None if device is None else torch.device(device)
        is_cuda = self.device is not None and self.device.type == "cuda"
        self.pin_memory = is_cuda if pin_memory is None else pin_memory
        self.non_blocking = non_blocking
        if ops is None and is_cuda:
            ops = CudaStreamOps(self.device)  # type: ignore[arg-type]
        self._ops = ops
        self._side_stream: Any = None

    @property
    def is_noop(self) -> bool:
        """True when batches stay where they are (no device, or the CPU)."""
        return self._ops is None and (self.device is None or self.device.type == "cpu")

    def send(self, batch: Any) -> InFlight:
        """Starts the copy of ``batch`` (producer thread); returns it with its event."""
        if self.is_noop:
            return InFlight(batch)
        ops = self._ops
        if ops is None:  # an accelerator without stream support: copy synchronously
            target = self.device
            return InFlight(map_tensors(lambda t: t.to(target), batch))
        if self._side_stream is None:
            self._side_stream = ops.new_stream()
        stream = self._side_stream
        with ops.use(stream):
            moved = map_tensors(
                lambda t: ops.copy(t, pin_memory=self.pin_memory, non_blocking=self.non_blocking),
                batch,
            )
            # Recorded after every copy of this batch was queued on the side stream.
            event = ops.record_event(stream)
        return InFlight(moved, event)

    def receive(self, inflight: InFlight) -> Any:
        """Finishes the hand-over (consumer thread); returns a batch usable right away."""
        if self._ops is None or inflight.event is None:
            return inflight.batch
        consumer = self._ops.current_stream()
        self._ops.wait_event(consumer, inflight.event)
        for tensor in iter_tensors(inflight.batch):
            self._ops.record_stream(tensor, consumer)
        return inflight.batch


def make_transfer(
    device: torch.device | str | None, *, pin_memory: bool | None, non_blocking: bool
) -> DeviceTransfer:
    """Builds the :class:`DeviceTransfer` a :class:`~asynccache.torch.fetcher.Fetcher` uses.

    A CUDA device without an index is pinned to the caller's current device here,
    on the consumer thread, so that the producer thread copies to the same one.

    Raises:
        ConfigError: A CUDA device is asked for and CUDA is not available.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"device {device} was asked for, but CUDA is not available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
    return DeviceTransfer(device, pin_memory=pin_memory, non_blocking=non_blocking)
