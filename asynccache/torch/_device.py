"""Moving batches to a device without making the training step wait for the copy.

A batch is any pytree of tensors: dicts (and other mappings), lists, tuples and
namedtuples, dataclasses, nested freely, and objects with their own ``.to()``
method; every other leaf passes through untouched.

The copy is split in two halves so that it can run on another thread:

* :meth:`DeviceTransfer.send` runs on the producer thread. For CUDA it pins the
  host tensors (if asked), issues the copies on a side stream and records one
  event on that stream after the batch's last copy.
* :meth:`DeviceTransfer.receive` runs on the consumer thread. It makes the
  consumer's current stream wait on that event, and marks every device tensor as
  used by the consumer's stream (``Tensor.record_stream``), so that the caching
  allocator does not hand its memory back to the side stream while the step still
  reads it. Whatever cannot be copied safely on the producer thread (objects with
  their own ``.to()``, every non-CUDA accelerator) is moved here, on the consumer's
  thread and stream.

Invariant: a batch returned by ``receive`` is safe to use on the consumer's current
stream; nothing on the host blocks on the copy, except when the source hands out
pinned memory (see :meth:`DeviceTransfer.send`).

A ``DeviceTransfer`` built for ``"cuda"`` without an index is a template:
:meth:`DeviceTransfer.bind` resolves it to the caller's current device when an
epoch starts.

The CUDA calls sit behind a small :class:`StreamOps` protocol, so the ordering logic
is testable on a machine without a GPU by passing a fake.
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
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


def _has_own_to(obj: Any) -> bool:
    return not isinstance(obj, type) and callable(getattr(obj, "to", None))


def map_tensors(
    fn: Callable[[torch.Tensor], torch.Tensor],
    tree: Any,
    *,
    move_object: Callable[[Any], Any] | None = None,
) -> Any:
    """Returns a copy of ``tree`` with ``fn`` applied to every tensor leaf.

    Containers are rebuilt the way ``DataLoader``'s ``pin_memory`` rebuilds them:
    a mutable mapping is shallow-copied and updated (so a subclass keeps its type
    and extra state, ``OrderedDict`` stays ordered), another mapping is rebuilt with
    its type, and one that cannot be rebuilt becomes a plain ``dict``; a list
    subclass is shallow-copied and refilled; namedtuples keep their fields;
    dataclass instances are rebuilt with :func:`dataclasses.replace`. The input is
    never mutated.

    A tensor that appears several times in ``tree`` is mapped once, and every place
    gets the same result. Objects with their own ``.to()`` method are passed to
    ``move_object`` when given, and are otherwise left as they are.
    """
    memo: dict[int, torch.Tensor] = {}

    def one(tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor)
        if key not in memo:
            memo[key] = fn(tensor)
        return memo[key]

    return _map(one, tree, move_object)


def _map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any, move: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (str, bytes)):
        return tree
    if isinstance(tree, Mapping):
        items = {key: _map(fn, value, move) for key, value in tree.items()}
        if type(tree) is dict:
            return items
        try:
            if isinstance(tree, MutableMapping):
                clone = copy_module.copy(tree)
                clone.update(items)
                return clone
            return type(tree)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(tree, tuple):
        mapped = [_map(fn, value, move) for value in tree]
        if hasattr(tree, "_fields"):  # namedtuple: positional constructor
            return type(tree)(*mapped)
        if type(tree) is tuple:
            return tuple(mapped)
        try:
            return type(tree)(mapped)
        except TypeError:
            return tuple(mapped)
    if isinstance(tree, list):
        mapped = [_map(fn, value, move) for value in tree]
        if type(tree) is list:
            return mapped
        try:
            refilled = copy_module.copy(tree)
            refilled[:] = mapped
            return refilled
        except TypeError:
            return mapped
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {
            field.name: _map(fn, getattr(tree, field.name), move)
            for field in dataclasses.fields(tree)
            if field.init and hasattr(tree, field.name)
        }
        return dataclasses.replace(tree, **changes)
    if move is not None and _has_own_to(tree):
        return move(tree)
    return tree


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Yields every distinct tensor leaf of ``tree`` once, in the order :func:`map_tensors`
    visits them (containers and dataclasses; not the inside of objects with ``.to()``)."""
    seen: set[int] = set()
    for tensor in _iter(tree):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def _iter(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (str, bytes)):
        return
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from _iter(value)
    elif isinstance(tree, (tuple, list)):
        for value in tree:
            yield from _iter(value)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for field in dataclasses.fields(tree):
            if field.init and hasattr(tree, field.name):
                yield from _iter(getattr(tree, field.name))


def _move_object(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    """``obj.to(device, non_blocking=...)``, or ``obj.to(device)`` for a ``.to()``
    that does not take ``non_blocking``."""
    try:
        return obj.to(device, non_blocking=non_blocking)
    except TypeError:
        return obj.to(device)


class StreamOps(Protocol):
    """The device, stream, event and copy primitives a :class:`DeviceTransfer` uses."""

    def set_device(self, device: torch.device) -> None:
        """Makes ``device`` the calling thread's current device (producer thread)."""

    def new_stream(self, device: torch.device) -> Any:
        """Returns a fresh side stream for the copies."""

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        """Makes ``stream`` current for the enclosed block."""

    def current_stream(self, device: torch.device) -> Any:
        """Returns the calling thread's current stream on ``device``."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns a page-locked copy of the (contiguous) host ``tensor``."""

    def copy(self, tensor: torch.Tensor, device: torch.device, *, non_blocking: bool) -> Any:
        """Copies one tensor to ``device`` on the current stream."""

    def record_event(self, stream: Any) -> Any:
        """Records and returns an event on ``stream`` after the work queued so far."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Makes future work on ``stream`` wait for ``event``; never blocks the host."""

    def synchronize_event(self, event: Any) -> None:
        """Blocks the calling thread until the work before ``event`` has finished."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tells the allocator that ``tensor`` is used by ``stream``."""


class CudaStreamOps:
    """:class:`StreamOps` for CUDA."""

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def copy(self, tensor: torch.Tensor, device: torch.device, *, non_blocking: bool) -> Any:
        return tensor.to(device, non_blocking=non_blocking)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)


@dataclass(frozen=True)
class InFlight:
    """A batch whose copy was issued by :meth:`DeviceTransfer.send`; ``event`` marks its end.

    ``pending``: the batch still holds objects that :meth:`DeviceTransfer.receive`
    moves on the consumer thread.
    """

    batch: Any
    event: Any = None
    pending: bool = False


def _current_cuda_device() -> int:
    return torch.cuda.current_device()


class DeviceTransfer:
    """Copies batches to a device on a side stream; see the module docstring.

    Args:
        device: The target device. ``None`` or a CPU device makes both halves no-ops
            that return the batch object itself. ``"cuda"`` without an index is
            resolved by :meth:`bind`.
        pin_memory: Pin host tensors before a CUDA copy. ``None`` means "yes for
            CUDA". Ignored for every other device.
        non_blocking: Issue the host-to-device copies asynchronously.
        ops: The stream primitives; defaults to :class:`CudaStreamOps` for CUDA
            devices. Tests pass a fake here.

    Only CUDA is copied on the producer thread. Every other accelerator (MPS, XPU,
    ...) gets a plain ``tensor.to(device)`` in :meth:`receive`, on the consumer
    thread: MPS, for one, is not thread-safe.
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
        self.is_cuda = self.device is not None and self.device.type == "cuda"
        self.pin_memory = self.is_cuda if pin_memory is None else pin_memory and self.is_cuda
        self.non_blocking = non_blocking
        self._given_ops = ops
        if ops is None and self.is_cuda:
            ops = CudaStreamOps()
        self._ops = ops if self.is_cuda else None
        self._side_stream: Any = None

    @property
    def is_noop(self) -> bool:
        """True when batches stay where they are (no device, or the CPU)."""
        return self.device is None or self.device.type == "cpu"

    def bind(self) -> DeviceTransfer:
        """Returns a transfer for one epoch: ``"cuda"`` without an index becomes the
        caller's current CUDA device (call it on the consumer thread)."""
        device = self.device
        if self.is_cuda and device is not None and device.index is None:
            device = torch.device("cuda", _current_cuda_device())
        return DeviceTransfer(
            device,
            pin_memory=self.pin_memory,
            non_blocking=self.non_blocking,
            ops=self._given_ops,
        )

    def enter_thread(self) -> None:
        """Prepares the producer thread; call it first thing there.

        For CUDA it makes the target the thread's current device, so that the
        thread's stream and context calls land on it and not on device 0.
        """
        if self._ops is not None and self.device is not None:
            self._ops.set_device(self.device)

    def send(self, batch: Any) -> InFlight:
        """Starts the copy of ``batch`` (producer thread); returns it with its event.

        A CPU tensor that is already pinned is copied straight from its memory. The
        source may reuse that memory once the copy has read it, so in that case
        ``send`` waits for the batch's copy to finish before it returns.
        """
        if self.is_noop:
            return InFlight(batch)
        ops, device = self._ops, self.device
        assert device is not None
        if ops is None:  # not CUDA: everything moves on the consumer thread
            return InFlight(batch, pending=True)
        if self._side_stream is None:
            self._side_stream = ops.new_stream(device)
        stream = self._side_stream
        source_pinned = False
        has_objects = False

        def note_object(obj: Any) -> Any:
            nonlocal has_objects
            has_objects = True
            return obj  # moved by receive(), on the consumer's thread and stream

        def copy(tensor: torch.Tensor) -> Any:
            nonlocal source_pinned
            if tensor.device.type == "cpu":
                if ops.is_pinned(tensor):
                    source_pinned = True
                elif self.pin_memory:
                    tensor = ops.pin(tensor.contiguous())
            return ops.copy(tensor, device, non_blocking=self.non_blocking)

        with ops.use(stream):
            moved = map_tensors(copy, batch, move_object=note_object)
            # Recorded after every copy of this batch was queued on the side stream.
            event = ops.record_event(stream)
        if source_pinned:
            ops.synchronize_event(event)  # the source may refill its pinned buffers next
        return InFlight(moved, event, pending=has_objects)

    def receive(self, inflight: InFlight) -> Any:
        """Finishes the hand-over (consumer thread); returns a batch usable right away."""
        batch = inflight.batch
        ops, device = self._ops, self.device
        if ops is not None and inflight.event is not None and device is not None:
            consumer = ops.current_stream(device)
            ops.wait_event(consumer, inflight.event)
            for tensor in iter_tensors(batch):
                ops.record_stream(tensor, consumer)
        if inflight.pending and device is not None:
            nb = self.non_blocking and self.is_cuda
            if self.is_cuda:  # the tensors were copied by send(); only objects are left

                def move(tensor: torch.Tensor) -> torch.Tensor:
                    return tensor
            else:

                def move(tensor: torch.Tensor) -> torch.Tensor:
                    return tensor.to(device)

            batch = map_tensors(move, batch, move_object=lambda obj: _move_object(obj, device, nb))
        return batch


def make_transfer(
    device: torch.device | str | None, *, pin_memory: bool | None, non_blocking: bool
) -> DeviceTransfer:
    """Builds the :class:`DeviceTransfer` a :class:`~asynccache.torch.fetcher.Fetcher` uses.

    A CUDA device without an index stays unresolved here; :meth:`DeviceTransfer.bind`
    resolves it when an epoch starts. ``pin_memory=True`` with a device other than
    CUDA warns once, here: it has no effect there.

    Raises:
        ConfigError: A CUDA device is asked for and CUDA is not available.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {device} was asked for, but CUDA is not available")
    if pin_memory and (device is None or device.type != "cuda"):
        warnings.warn(
            f"pin_memory=True has no effect for device {device}: only CUDA copies are pinned",
            UserWarning,
            stacklevel=3,
        )
    return DeviceTransfer(device, pin_memory=pin_memory, non_blocking=non_blocking)
