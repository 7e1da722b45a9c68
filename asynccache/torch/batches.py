"""Whole batches from a DataLoader worker, in reused shared-memory buffers.

A worker that assembles batches itself (see :mod:`asynccache.read.batchread`) writes each
into a buffer of a small per-worker pool of shared-memory storages. The main process maps
each buffer once (the first batch in it carries its storage; the main process writes an
acknowledgement into the shared block) and keeps the mapping; later batches in that
buffer travel as a few integers and the batch's form. So a batch costs no new
shared-memory segment, no descriptor passing and no new mapping.

The rule that makes reuse safe: **a buffer is never written while the consumer may still
hold any part of the batch in it.** Each worker has a row of busy marks in a small block
of shared memory that the dataset created before its workers started:

* the worker writes a fresh mark (its pid and a sequence number) into a slot's cell
  before it hands the batch over, and only takes a slot whose cell is 0;
* the main process, when it unpickles the batch, gives it a storage of its own over the
  mapping and attaches a finalizer to it; when the last tensor, view or numpy array over
  that storage is gone the finalizer clears the cell, if it still holds that batch's mark;
* a worker that finds no free slot adds one, up to :data:`POOL_SLOTS`; past that it
  allocates a buffer used once (as ``default_collate`` does). It never waits.

What keeps a batch's buffer busy: any tensor of the batch, any view or slice of one,
``.numpy()`` of one, or its storage. ``pin_memory`` and ``.to(device)`` copy, so the
buffer frees as soon as the pinned / device copy is made and the batch dropped.

Cells left behind by a worker process that died (a batch it sent that was never
received) are reclaimed by the next worker process on that row.

**Each worker process has a row of its own.** Two loaders iterating one dataset at the
same time (two ``CacheDataLoader`` objects over it, zipped; a persistent loader's idle
workers beside a new loader's) have workers with the same ids. A worker claims a row when
it makes its pool: its preferred row (its worker id) if no other live process owns it,
else the next row that none does; the owner's pid is kept in the row. On Linux the claim
also takes the row's lock, a Unix socket bound to the row's name in the abstract
namespace: one live process at a time holds it, and it goes with the process. Elsewhere
claims are not atomic: two workers starting at the same moment can both write the same
row's owner, and the last write wins. So before it hands a batch over, a worker checks
that the row is still its own, with the batch's mark already written in its cell; one
that lost the row claims another and starts a fresh set of buffers there (the consumer may
still hold batches in its old ones, whose cells keep their marks). More live worker
processes than rows raise :class:`~asynccache.errors.ConfigError`.

**Buffers outlive their worker.** The consumer keeps each buffer mapped after the worker
that made it is gone (the workers of a loader without ``persistent_workers`` end with
each epoch). A worker forked from the consumer inherits those mappings; holding its row's
lock, it writes its batches into the buffers the row's earlier owner left, each that is
free and mapped under the id the consumer acknowledged. So an epoch's new workers find
their buffers' pages in memory and send no storage; a buffer whose cell is still marked
(a batch the consumer holds, or one sent and never received) is left alone.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import sys
import weakref
from typing import Any

import numpy as np
import torch

from ..bridge.lifeline import pid_alive
from ..errors import ConfigError
from ..format.memory import fresh_bytes, populate
from ..read.batchread import OBJECT_KINDS, Form

POOL_SLOTS = 8  # pooled buffers per worker, at most
POOL_BYTES = 256 << 20  # ... and no more than about this much (at least 2 buffers)
ROWS = 256  # worker rows (worker id mod ROWS - 1; the last row: the main process)
MAIN_ROW = ROWS - 1
COUNTERS = (
    "assembled",
    "collated",
    "pooled_buffers",
    "unpooled_buffers",
    "sent_buffers",
    "adopted_buffers",
    "borrowed_buffers",
)
_ACK = POOL_SLOTS  # columns [_ACK, _ACK + POOL_SLOTS): the buffer the consumer has mapped
_COUNT = 2 * POOL_SLOTS
_OWNER = _COUNT + len(COUNTERS)  # the pid of the process whose pool holds the row
_COLS = _OWNER + 1
BLOCK_BYTES = ROWS * _COLS * 8

# The busy blocks of datasets created in this process, by token (the main process
# looks a received batch's block up here).
_BLOCKS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
# The consumer's mappings of the workers' pooled buffers: token -> (row, slot) ->
# (buffer id, uint8 numpy array over the shared storage).
_MAPS: dict[str, dict[tuple[int, int], tuple[int, np.ndarray]]] = {}


def shared_bytes(n: int) -> torch.Tensor:
    """``n`` zero bytes of shared memory (kernel-zeroed: no torch fill, which would run on
    torch's intra-op pool, unsafe in a forked worker)."""
    storage = torch.UntypedStorage._new_shared(max(n, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:n]


def register(token: str, block: torch.Tensor) -> None:
    """Make ``block`` (a dataset's busy marks) findable by batches received here; the
    mappings of its workers' buffers go with it."""
    _BLOCKS[token] = block
    weakref.finalize(block, _MAPS.pop, token, None).atexit = False


def table(block: torch.Tensor) -> np.ndarray:
    """The ``(ROWS, columns)`` int64 view of a busy block."""
    return block.numpy().view(np.int64).reshape(ROWS, _COLS)


def counters(block: torch.Tensor) -> dict[str, int]:
    """The batch counters summed over every worker row."""
    sums = table(block)[:, _COUNT:_OWNER].sum(axis=0)
    return {name: int(v) for name, v in zip(COUNTERS, sums, strict=True)}


def count(block: torch.Tensor, row: int, name: str, by: int = 1) -> None:
    table(block)[row % ROWS, _COUNT + COUNTERS.index(name)] += by


def _free(token: str, row: int, slot: int, mark: int) -> None:
    block = _BLOCKS.get(token)
    if block is None:
        return
    cells = table(block)
    if int(cells[row, slot]) == mark:  # else a newer worker process owns the cell now
        cells[row, slot] = 0


def _rebuilt(
    token: str, row: int, slot: int, mark: int, mem: np.ndarray, build: Any, args: tuple[Any, ...]
) -> Any:
    """``build(base, *args)`` over a storage of this batch's own (``base``, over ``mem``):
    the slot is freed once that storage is collected, that is once the consumer holds no
    view of it (at once, when the batch holds none)."""
    base = torch.from_numpy(mem)
    data = build(base, *args)
    fin = weakref.finalize(base.untyped_storage(), _free, token, row, slot, mark)
    fin.atexit = False
    return data


def _unpickled(
    token: str,
    row: int,
    slot: int,
    mark: int,
    buffer_id: int,
    storage: Any,
    build: Any,
    args: tuple[Any, ...],
) -> Any:
    """In the consumer: the batch in slot ``slot`` of worker row ``row``, as
    ``build(base, *args)`` makes it from the buffer (``base``: a uint8 tensor over it).

    The first batch of a buffer brings its shared storage (``storage``), which this
    process maps once, keeps, and acknowledges in the block; later batches of the buffer
    bring only where they are. Each batch gets a storage of its own over the mapping, so
    its end (the consumer letting go) frees the slot.
    """
    maps = _MAPS.setdefault(token, {})
    if storage is not None:
        base = torch.empty(0, dtype=torch.uint8).set_(storage)
        maps[(row, slot)] = (buffer_id, base.numpy())
        block = _BLOCKS.get(token)
        if block is not None:
            table(block)[row, _ACK + slot] = buffer_id
    got = maps.get((row, slot))
    if got is None or got[0] != buffer_id:  # not acknowledged, so never sent without it
        raise RuntimeError(f"batch buffer {buffer_id} of worker row {row} was never received")
    return _rebuilt(token, row, slot, mark, got[1], build, args)


def _wrapped(base: torch.Tensor, form: Form, n: int, objects: list[Any] | None) -> Any:
    return wrap(form, base, n, objects)


def _row_lock(token: str, row: int) -> tuple[bool, socket.socket | None]:
    """Whether this process may hold ``row`` of the block ``token``, and the lock that
    says so: a Unix socket bound to a name in the abstract namespace, which one process
    at a time can hold and which goes with the process (no file left behind). Off Linux:
    (True, None), no lock."""
    if not sys.platform.startswith("linux"):
        return True, None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(f"\0asynccache-rows-{token}-{row}")
    except OSError:  # another live process holds the row
        sock.close()
        return False, None
    return True, sock


class Pooled:
    """A batch in a pooled buffer, as a worker hands it over: unpickles as the batch."""

    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickled, self.args)


class Pool:
    """One worker process's pooled buffers (see the module docstring).

    ``row``: the row it prefers (the worker id; the main process: :data:`MAIN_ROW`); it
    uses that row unless another live process owns it (``self.row``: the row it holds).
    """

    def __init__(self, block: torch.Tensor, token: str, row: int, here: bool = False) -> None:
        self.block, self.token = block, token
        # here: the consumer is this process. The buffers are plain memory, and each batch
        # gets a storage of its own over its buffer (the pool holds the buffer, not that
        # storage, so the storage's end is the consumer letting go).
        self.here = here
        # Ids and marks start at a random point: a pool made again in this process, or in
        # a later process given the same pid, never repeats an id the consumer knows.
        self._seq = itertools.count(secrets.randbits(32))
        self._claim(row % ROWS)

    def _claim(self, preferred: int, lost: int = -1) -> None:
        """Hold ``preferred`` row, or the first after it that no other live process owns
        (not ``lost``, a row just lost to another process), with a fresh set of buffers,
        or those the consumer keeps mapped from the row's earlier owner (:meth:`_adopt`)."""
        owners = table(self.block)[:, _OWNER]
        pid = os.getpid()
        # (The consumer keeps its own row: each process iterating has a block of its own.)
        order = [preferred] if self.here else [(preferred + k) % MAIN_ROW for k in range(MAIN_ROW)]
        old = getattr(self, "_lock", None)
        if old is not None:
            old.close()
        self._lock: socket.socket | None = None
        for r in order:
            owner = int(owners[r])
            if r == lost or (owner not in (0, pid) and pid_alive(owner)):
                continue
            locked, self._lock = (True, None) if self.here else _row_lock(self.token, r)
            if locked or owner == pid:
                owners[r] = pid
                if self._lock is not None:
                    weakref.finalize(self, self._lock.close)
                break
        else:
            raise ConfigError(
                f"more than {MAIN_ROW} DataLoader worker processes read whole batches of one "
                "StreamingDataset at the same time (its batch buffers have a row per live "
                "worker); end some loaders' iterations, or use fewer workers"
            )
        self.row = r
        cells = table(self.block)[r]
        self.cells, self.acks = cells[:POOL_SLOTS], cells[_ACK : _ACK + POOL_SLOTS]
        self.buffers: dict[int, torch.Tensor] = {}
        self.ids: dict[int, int] = {}
        self.memory: dict[int, np.ndarray] = {}
        self.inherited: set[int] = set()  # adopted slots not yet written in this process
        if self._lock is not None:
            self._adopt()
        for k, mark in enumerate(self.cells.tolist()):
            if mark and (mark >> 32 == pid or not pid_alive(mark >> 32)):
                # Left by a dead process (or this pid's previous life): the consumer may
                # still hold that batch, so its buffer is never adopted (its id is no
                # longer the acknowledged one); this pool makes a fresh one for the slot.
                self.cells[k] = 0
                self.acks[k] = 0

    def _adopt(self) -> None:
        """Write into the buffers the consumer keeps mapped from this row's earlier owner
        (a worker of an earlier epoch; this process inherited the consumer's mappings when
        it was forked), their pages already in memory: each one whose cell is free (the
        consumer holds nothing of it and no batch in it is on its way) and that the
        consumer mapped under the id it acknowledged. Only the holder of the row's lock
        adopts: two processes never write one buffer."""
        for (row, k), (buffer_id, mem) in _MAPS.get(self.token, {}).items():
            if row == self.row and int(self.cells[k]) == 0 and int(self.acks[k]) == buffer_id:
                self.buffers[k], self.ids[k] = torch.from_numpy(mem), buffer_id
                self.inherited.add(k)
                count(self.block, self.row, "adopted_buffers")

    def borrow_idle(self, want: int, busy_rows: int = ROWS) -> int:
        """The consumer's own pool (``here``), before its workers fork: take over as many
        buffers as it lacks for ``want`` batches from those it keeps mapped from worker
        rows whose owner is gone (an earlier epoch's workers), each free (the consumer
        holds nothing of it). A buffer taken leaves the row: no worker forked later adopts
        it (that row makes a fresh one if it needs it). So it takes first from the rows at
        and after ``busy_rows`` (by default none), whose next workers build no batch in their
        first round; then one of each busy row before a second of any, the last row first
        (its worker's first batch comes last); largest first within each. So the first
        batches this process builds go into pages already in memory, not fresh ones
        (256 MiB of fresh pages: 0.2 s of faults), and each worker that builds a batch soon
        still has one to adopt where there are enough. The number taken."""
        assert self.here, "only the consumer's pool borrows its idle buffers"
        maps = _MAPS.get(self.token)
        empty = [k for k in range(POOL_SLOTS) if self.cells[k] == 0 and k not in self.memory]
        have = sum(1 for k in range(POOL_SLOTS) if self.cells[k] == 0 and k in self.memory)
        need = min(want - have, len(empty))
        if not maps or need <= 0:
            return 0
        cells = table(self.block)
        owners: dict[int, bool] = {}

        def gone(row: int) -> bool:
            if row not in owners:
                pid = int(cells[row, _OWNER])
                owners[row] = pid == 0 or not pid_alive(pid)
            return owners[row]

        idle = [
            (mem.size, key)
            for key, (buffer_id, mem) in maps.items()
            if key[0] != self.row
            and int(cells[key[0], key[1]]) == 0
            and int(cells[key[0], _ACK + key[1]]) == buffer_id
            and gone(key[0])
        ]
        idle.sort(reverse=True)
        nth: dict[int, int] = {}  # row -> its buffers placed so far
        order = []
        for size, key in idle:  # the largest of each row, then each row's second, ...
            row = key[0]
            nth[row] = nth.get(row, 0) + 1
            busy = row < busy_rows
            order.append((busy, nth[row] if busy else 0, -size, -row, key))
        order.sort()
        for k, (*_, key) in zip(empty[:need], order, strict=False):
            self.memory[k] = maps.pop(key)[1]
            self.inherited.add(k)
            count(self.block, self.row, "borrowed_buffers")
        return min(need, len(idle))

    def _owned(self) -> bool:
        return int(table(self.block)[self.row, _OWNER]) == os.getpid()

    def _id(self) -> int:
        return (os.getpid() << 32) | (next(self._seq) & 0xFFFFFFFF)

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free slot and its buffer of at least ``nbytes`` (slot -1: not pooled)."""
        got = self.take_free(nbytes)
        if got is not None:
            return got
        count(self.block, self.row, "unpooled_buffers")
        if self.here:
            return -1, torch.empty(nbytes, dtype=torch.uint8)
        return -1, shared_bytes(nbytes)

    def take_free(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """A free slot and its buffer of at least ``nbytes``; None: none is free."""
        for k in range(max(2, min(POOL_SLOTS, POOL_BYTES // max(nbytes, 1)))):
            if self.cells[k] != 0:
                continue
            if self.here:
                mem = self.memory.get(k)
                if mem is None or mem.size < nbytes:
                    if mem is None:
                        count(self.block, self.row, "pooled_buffers")
                    mem = self.memory[k] = fresh_bytes(nbytes)
                elif k in self.inherited:  # (borrowed: the pages exist, as for adopted ones)
                    populate(mem[:nbytes])
                self.inherited.discard(k)
                return k, torch.from_numpy(mem)
            buf = self.buffers.get(k)
            if buf is None or buf.numel() < nbytes:
                if buf is None:
                    count(self.block, self.row, "pooled_buffers")
                buf = self.buffers[k] = shared_bytes(nbytes)
                self.ids[k] = self._id()
            elif k in self.inherited:
                # Its pages exist, but not in this process's page tables: mapped in one
                # call, not a fault per page as the batch is written (format/memory.py).
                populate(buf[:nbytes].numpy())
            self.inherited.discard(k)
            return k, buf
        return None

    def send(
        self,
        form: Form,
        n: int,
        slot: int,
        buf: torch.Tensor,
        objects: list[Any] | None = None,
    ) -> Any:
        """The batch of ``n`` rows laid out by ``form`` in slot ``slot``'s buffer ``buf``
        (its str / bytes leaves' lists: ``objects``, as ``assemble_into`` returned them),
        as the consumer will get it; the slot is busy until the consumer drops it."""
        return self.hand_over(slot, buf, _wrapped, (form, n, objects))

    def hand_over(self, slot: int, buf: torch.Tensor, build: Any, args: tuple[Any, ...]) -> Any:
        """The batch in slot ``slot``'s buffer ``buf`` as the consumer will get it:
        ``build(base, *args)`` (a module-level function: it travels by name), ``base`` a
        uint8 tensor over the buffer there. The slot is busy until the consumer holds no
        view of ``base``."""
        if slot < 0:
            return build(buf, *args)
        mark = self._id()
        self.cells[slot] = mark
        if not self.here and not self._owned():
            # Another worker claimed this row at the same moment as this one and won.
            # The mark stays (the other's batch in this slot, if any, stays busy); this
            # batch goes in a buffer used once, and later ones in a row of this process.
            self._claim(self.row, lost=self.row)
            count(self.block, self.row, "unpooled_buffers")
            out = shared_bytes(buf.numel())
            out.numpy()[:] = buf.numpy()  # (numpy: no torch thread pool in a forked worker)
            return build(out, *args)
        if self.here:
            return _rebuilt(self.token, self.row, slot, mark, buf.numpy(), build, args)
        buffer_id = self.ids[slot]
        storage = None
        if int(self.acks[slot]) != buffer_id:  # the consumer has not mapped it yet
            storage = buf.untyped_storage()
            count(self.block, self.row, "sent_buffers")
        return Pooled(self.token, self.row, slot, mark, buffer_id, storage, build, args)


_TORCH_DTYPES: dict[tuple[str, str], torch.dtype | None] = {}


def torch_dtype(kind: str, dtype: str) -> torch.dtype | None:
    """The torch dtype of a leaf as ``default_collate`` would make it (None: none, or a
    str / bytes leaf, which is a list)."""
    key = (kind, dtype)
    if key not in _TORCH_DTYPES:
        got: torch.dtype | None
        if kind == "t":
            got = getattr(torch, dtype, None)
            got = got if isinstance(got, torch.dtype) else None
        elif kind in ("a", "g"):
            try:
                got = torch.from_numpy(np.empty(0, np.dtype(dtype))).dtype
            except (TypeError, ValueError):
                got = None
        else:
            got = {"i": torch.int64, "f": torch.float64, "b": torch.bool}.get(kind)
        _TORCH_DTYPES[key] = got
    return _TORCH_DTYPES[key]


def supported(form: Form, objects: bool = False) -> bool:
    """Every leaf of ``form`` has a torch dtype, or is a str / bytes leaf and the caller
    carries their lists (``objects``); else the batch is collated per item."""
    return all(
        (objects and leaf.kind in OBJECT_KINDS) or torch_dtype(leaf.kind, leaf.dtype) is not None
        for leaf in form.leaves
    )


def wrap(form: Form, buf: torch.Tensor, batch: int, objects: list[Any] | None = None) -> Any:
    """The batch ``default_collate`` would build, as views of ``buf`` (laid out by
    :meth:`Form.regions` for ``batch`` rows), with ``objects`` (the str / bytes leaves'
    values, in leaf order, as ``assemble_into`` returned them: lists, or where bytes
    were copied into ``buf``) as lists (tuples under a list or tuple, as default_collate
    leaves them there)."""
    regions, _ = form.regions(batch)
    values: list[Any] = []
    spare = iter(objects or ())
    for leaf, start in zip(form.leaves, regions, strict=True):
        if leaf.kind in OBJECT_KINDS:
            got = next(spare)
            if isinstance(got, np.ndarray):  # bytes copied into the buffer: (start, length)
                mem = buf.numpy()
                got = [mem[a : a + n].tobytes() for a, n in got.tolist()]
            values.append(got)
            continue
        dt = torch_dtype(leaf.kind, leaf.dtype)
        assert dt is not None
        n = leaf.nbytes * batch
        values.append(buf[start : start + n].view(dt).reshape(batch, *leaf.shape))
    return _build(form.tree, values, False)


def _build(node: tuple[Any, ...], values: list[Any], in_seq: bool) -> Any:
    # (A module function, not a closure: a recursive closure is a reference cycle, which
    # would keep the batch's storage alive until the garbage collector ran.)
    if node[0] == "leaf":
        v = values[node[1]]
        return tuple(v) if in_seq and isinstance(v, list) else v
    if node[0] == "dict":
        return {k: _build(c, values, False) for k, c in zip(node[1], node[2], strict=True)}
    return [_build(c, values, True) for c in node[1]]
