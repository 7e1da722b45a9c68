"""Batches a ``collate_fn`` made in a DataLoader worker, handed over in pooled buffers.

Where a loader collates items per item (a ``collate_fn``, a ``transform``), its DataLoader
workers pickle each batch to the main process. torch moves a tensor's storage into a new
shared-memory segment (a fresh mapping in both processes, one per tensor), and a numpy
array is copied into the pickle, through the pipe and out again: four copies of every
byte, the cost the same DataLoader over items in RAM pays too.

:class:`HandedOver` wraps the user's ``collate_fn``. In a worker of a streaming dataset
it copies the batch's arrays, once, into one buffer of the worker's pool of shared memory
(the pool whole batches use, :mod:`.batches`), and the consumer gets views of its mapping
of that buffer, kept from batch to batch. What is moved:

* numpy arrays (``type(x) is np.ndarray``, no Python objects in the dtype, C-contiguous
  or not contiguous at all: the consumer gets a C-contiguous array, as pickle gives);
* plain CPU tensors not already in shared memory (``type(x) is torch.Tensor``, strided,
  contiguous, no grad, not quantized, no conjugate or negative bit);

found in dicts, lists and tuples (their exact types; anything else is pickled as it is,
with what it holds), when they come to :data:`MIN_BYTES` or more in all. Each comes out
with its dtype, shape and values, writable; an array the batch holds twice comes out as
one array held twice, as pickle keeps it. Tensors already in shared memory are left as
they are. ``default_collate`` itself (the per-item path of a ``transform``) would stack
each tensor of the batch into a new shared-memory segment; here it runs by its own rules
with the tensors stacked in plain memory, and the batch is handed over as above.

The buffer stays busy while the consumer holds any array or tensor of the batch, or any
view of one. A worker whose buffers are all busy (a consumer that keeps its batches)
pickles the batch as it is, as without the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from .batches import Pool, count

__all__ = ["MIN_BYTES", "HandedOver", "hand_over"]

#: Below this many bytes of arrays in a batch, pickling it costs less than a buffer's
#: bookkeeping.
MIN_BYTES = 64 << 10
_ALIGN = 64


class _Leaf:
    """Where the ``k``-th moved array goes back in the batch."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Leaf, (self.k,))


def _movable(x: Any) -> bool:
    t = type(x)
    if t is np.ndarray:
        return (
            bool(x.size)
            and not x.dtype.hasobject
            and (x.flags.c_contiguous or not x.flags.f_contiguous)
        )
    if t is torch.Tensor:
        return (
            x.device.type == "cpu"
            and x.layout == torch.strided
            and x.numel() > 0
            and not x.requires_grad
            and not x.is_quantized
            and not x.is_conj()
            and not x.is_neg()
            and x.is_contiguous()
            and not x.is_shared()
        )
    return False


def _strip(node: Any, moved: list[Any], seen: dict[int, Any]) -> Any:
    """``node`` with each movable array replaced by a :class:`_Leaf` (appended to
    ``moved``). A container or array met again gives what it gave the first time, so the
    skeleton keeps what the batch shares (and its cycles), as pickle would."""
    t = type(node)
    if t is dict or t is list or t is tuple:
        got = seen.get(id(node))
        if got is not None:
            return got
        if t is tuple:  # (a cycle through a tuple passes a list or a dict, met first)
            out_t = tuple(_strip(v, moved, seen) for v in node)
            seen[id(node)] = out_t
            return out_t
        if t is dict:
            out_d: dict[Any, Any] = {}
            seen[id(node)] = out_d
            for k, v in node.items():
                out_d[k] = _strip(v, moved, seen)
            return out_d
        out_l: list[Any] = []
        seen[id(node)] = out_l
        out_l.extend(_strip(v, moved, seen) for v in node)
        return out_l
    if _movable(node):
        leaf = seen.get(id(node))
        if leaf is None:
            leaf = seen[id(node)] = _Leaf(len(moved))
            moved.append(node)
        return leaf
    return node


def _fill(node: Any, arrays: list[Any], memo: dict[int, Any]) -> Any:
    """The batch of skeleton ``node``, its leaves ``arrays`` (shared parts shared)."""
    t = type(node)
    if t is _Leaf:
        return arrays[node.k]
    if t is dict or t is list or t is tuple:
        got = memo.get(id(node))
        if got is not None:
            return got
        if t is tuple:
            out_t = tuple(_fill(v, arrays, memo) for v in node)
            memo[id(node)] = out_t
            return out_t
        if t is dict:
            out_d: dict[Any, Any] = {}
            memo[id(node)] = out_d
            for k, v in node.items():
                out_d[k] = _fill(v, arrays, memo)
            return out_d
        out_l: list[Any] = []
        memo[id(node)] = out_l
        out_l.extend(_fill(v, arrays, memo) for v in node)
        return out_l
    return node


def _built(base: torch.Tensor, skeleton: Any, specs: list[tuple[int, int, Any, Any]]) -> Any:
    """In the consumer: the batch, its arrays views of ``base`` (a uint8 tensor over the
    buffer). ``specs``: each array's offset, bytes, dtype (numpy's or torch's), shape."""
    mem = base.numpy()
    arrays: list[Any] = []
    for off, nbytes, dtype, shape in specs:
        if isinstance(dtype, torch.dtype):
            arrays.append(base[off : off + nbytes].view(dtype).view(shape))
        else:
            arrays.append(mem[off : off + nbytes].view(dtype).reshape(shape))
    return _fill(skeleton, arrays, {})


def hand_over(batch: Any, pool: Pool) -> Any:
    """``batch`` as it travels to the consumer: its movable arrays copied into a buffer of
    ``pool`` (unchanged when they come to less than :data:`MIN_BYTES`)."""
    moved: list[Any] = []
    skeleton = _strip(batch, moved, {})
    if sum(a.nbytes for a in moved) < MIN_BYTES:
        return batch
    specs: list[tuple[int, int, Any, Any]] = []
    end = 0
    for a in moved:
        specs.append((end, a.nbytes, a.dtype, tuple(a.shape)))
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    got = pool.take_free(end)
    if got is None:  # every buffer busy (the consumer holds their batches): pickled
        count(pool.block, pool.row, "unpooled_buffers")
        return batch
    slot, buf = got
    mem = buf.numpy()
    for a, (off, nbytes, dtype, shape) in zip(moved, specs, strict=True):
        if isinstance(a, torch.Tensor):
            buf[off : off + nbytes].view(dtype).view(shape).copy_(a)
        else:
            np.copyto(mem[off : off + nbytes].view(dtype).reshape(shape), a, casting="no")
    del moved
    return pool.hand_over(slot, buf, _built, (skeleton, specs))


def _stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """``default_collate``'s rule for tensors, stacked in plain memory (in a worker it
    stacks into a new shared-memory segment; :func:`hand_over` moves it into the pool)."""
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:  # (its errors)
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    return torch.stack(batch, 0)


# default_collate's rules, tensors stacked by _stack (the arrays and numbers it makes
# tensors of go through it too).
_PLAIN = {**default_collate_fn_map, torch.Tensor: _stack}


class HandedOver:
    """The user's ``collate_fn`` (``fn``), its batches handed over in the worker's pooled
    buffers when it runs in a DataLoader worker of a dataset that has them (a
    ``StreamingDataset`` or a mix); elsewhere ``fn``'s batches as they are.
    ``default_collate`` there collates by its own rules into plain memory first."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, items: list[Any]) -> Any:
        info = get_worker_info()
        pool = None if info is None else getattr(info.dataset, "worker_pool", None)
        if pool is None:
            return self.fn(items)
        if self.fn is default_collate:
            return hand_over(collate(items, collate_fn_map=_PLAIN), pool())
        return hand_over(self.fn(items), pool())
