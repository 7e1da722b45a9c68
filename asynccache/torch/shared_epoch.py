"""The memory a dataset shares with its DataLoader workers: epoch counters, plan, statistics.

A dataset and every DataLoader worker process that iterates it (forked or spawned,
persistent or not) see one block of shared memory, created by the process that owns the
dataset:

* **epoch counters**, one per worker slot: worker ``w`` of ``W`` reads slot ``w`` and sets
  slots ``w, w+W, ...`` to the next epoch (:meth:`SharedEpoch.take_epoch`), so every slot
  advances once per epoch whatever the worker count, and no two workers of a loader touch
  the same slot: all workers of an epoch (and a later loader with another worker count)
  agree on the epoch they run;
* **the published plan**: what a worker needs to run an epoch (its position, batch size,
  worker count, rank and world, batch mode, the batches the main process handed out).
  Workers of a ``persistent_workers=True`` DataLoader keep the copy of the dataset they
  started with, so attributes set later in the main process would not reach them;
* **download statistics**, one row per process that iterates (worker ``w``: row
  ``w mod 256``; the main process: the last row), each cumulative over the processes
  that used it.

A copy of the dataset in another process that is not one of its DataLoader workers (a
forked child, a rank started with ``mp.spawn``, Lightning's ``ddp_spawn``) takes a block
of its own at its first use (:meth:`SharedEpoch.own`): otherwise the ranks would advance
each other's epochs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, ResumeStateError
from ..sampling.nodes import NodeLayout
from ..sampling.progress import Progress

__all__ = ["STAT_FIELDS", "SharedEpoch", "shared_bytes"]

SLOTS = 1024  # epoch counters, one per DataLoader worker slot
_PLAN_BYTES = 56 << 10  # room for the published plan (a few intervals in JSON)
_STAT_ROWS = 257
STAT_FIELDS = ("bytes", "chunks_fetched", "hits", "misses", "retries", "wait_s")
_PLAN_AT = SLOTS * 8
_STATS_AT = _PLAN_AT + 8 + _PLAN_BYTES
_BLOCK_BYTES = _STATS_AT + _STAT_ROWS * len(STAT_FIELDS) * 8


def shared_bytes(n: int) -> torch.Tensor:
    """``n`` zero bytes of shared memory, read and written through numpy views only.

    Created directly as shared memory (zero-filled by the kernel) rather than with
    ``torch.zeros(...).share_memory_()``: filling or copying that many bytes runs on
    torch's intra-op (OpenMP) pool, which hangs in a process forked from one that used it.
    """
    storage = torch.UntypedStorage._new_shared(n)  # (torch's only zero-fill-free way)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class SharedEpoch:
    """One dataset's block shared with its DataLoader workers (see the module docstring).

    Invariant: ``expect`` is the counter value this process last wrote or advanced to; a
    counter that differs means workers iterated the dataset since (this process then does
    not know what they yielded).
    """

    def __init__(self, where: str) -> None:
        self.where = where  # the dataset, for messages
        self.block = shared_bytes(_BLOCK_BYTES)
        self.owner = os.getpid()
        self.expect = 0
        self._stats_pid = -1  # the process whose statistics row base was taken
        self._stats_base = np.zeros(len(STAT_FIELDS))

    def own(self, in_worker: bool) -> bool:
        """Take a block of this process's own, unless it is the owner or a DataLoader worker
        (``in_worker``). True when a new block was taken (the counters and plan copied,
        the statistics at zero)."""
        pid = os.getpid()
        if self.owner == pid or in_worker:
            return False
        fresh = shared_bytes(self.block.numel())
        fresh.numpy()[:_STATS_AT] = self.block.numpy()[:_STATS_AT]
        self.block, self.owner = fresh, pid
        self._stats_pid, self._stats_base = -1, np.zeros(len(STAT_FIELDS))
        return True

    # -- epoch counters ------------------------------------------------------------
    def counters(self) -> np.ndarray:
        return self.block[:_PLAN_AT].numpy().view(np.int64)

    def set_epoch(self, epoch: int) -> None:
        """Every worker slot runs ``epoch`` next."""
        self.counters()[:] = epoch
        self.expect = epoch

    def take_epoch(self, worker: int, num_workers: int, pinned: int | None = None) -> int:
        """The epoch worker ``worker`` of ``num_workers`` runs now, and advance its slots
        past it. ``pinned``: the epoch it must run (a loaded worker state, or the epoch a
        batch the main process built came from)."""
        if num_workers > SLOTS:
            raise ConfigError(f"{self.where}: at most {SLOTS} DataLoader workers are supported")
        counters = self.counters()
        epoch = int(counters[worker]) if pinned is None else pinned
        counters[worker::num_workers] = epoch + 1
        self.expect = epoch + 1
        return epoch

    def iterated_elsewhere(self) -> bool:
        """DataLoader workers advanced the counters since this process last did."""
        return int(self.counters()[0]) != self.expect

    def check_state_here(self, kind: str) -> None:
        """A state can be taken in this process, which iterated the dataset itself.

        Raises:
            ResumeStateError: DataLoader workers iterated it (``kind``: the dataset's
                class): this process doesn't know what they yielded.
        """
        if self.iterated_elsewhere():
            raise ResumeStateError(
                f"{self.where}: this {kind} was iterated by DataLoader worker processes, "
                "so this process doesn't know what they yielded and its state_dict() "
                "would restart the epoch; iterate it with CacheDataLoader and save "
                "CacheDataLoader.state_dict() instead"
            )

    # -- the published plan --------------------------------------------------------
    def publish(self, plan: WorkerPlan) -> None:
        raw = json.dumps(plan.to_json()).encode()
        if len(raw) > _PLAN_BYTES:
            raise ResumeStateError(
                f"{self.where}: the epoch's position holds too many intervals "
                f"({len(raw)} bytes) to share with DataLoader workers"
            )
        head = _PLAN_AT
        self.block[head : head + 8].numpy().view(np.int64)[0] = len(raw)
        self.block[head + 8 : head + 8 + len(raw)].numpy()[:] = np.frombuffer(raw, np.uint8)

    def plan(self) -> WorkerPlan:
        """The plan last published."""
        n = int(self.block[_PLAN_AT : _PLAN_AT + 8].numpy().view(np.int64)[0])
        got = json.loads(bytes(self.block[_PLAN_AT + 8 : _PLAN_AT + 8 + n].numpy()))
        return WorkerPlan.from_json(got)

    # -- statistics ----------------------------------------------------------------
    def stat_table(self) -> np.ndarray:
        """One row of :data:`STAT_FIELDS` per process slot (see the module docstring)."""
        return self.block[_STATS_AT:].numpy().view(np.float64).reshape(_STAT_ROWS, -1)

    def report(self, worker: int | None, values: Sequence[float]) -> None:
        """Set this process's row (``worker``: its DataLoader worker id; None: the main
        process) to its cumulative counters ``values`` on top of its predecessors'."""
        row = _STAT_ROWS - 1 if worker is None else worker % (_STAT_ROWS - 1)
        table = self.stat_table()
        pid = os.getpid()
        if self._stats_pid != pid:  # a new process: the row holds its predecessors'
            self._stats_base = table[row].copy()
            self._stats_pid = pid
        table[row] = self._stats_base + np.asarray(values, dtype=np.float64)

    def totals(self) -> dict[str, float]:
        total = self.stat_table().sum(axis=0)
        return {f: float(v) for f, v in zip(STAT_FIELDS, total, strict=True)}


@dataclasses.dataclass
class WorkerPlan:
    """What a DataLoader worker needs to run an epoch where every worker reads it, as the
    main process publishes it: the position, how the consumer reads (batch size, workers,
    whole batches or items, a dropped short batch), this rank's place (DP rank and size,
    the nodes), the samples the main process handed out itself (``head``) and the
    dataset's own ``extra`` (JSON-ready)."""

    progress: Progress
    batch_size: int
    num_workers: int | None
    rank_world: tuple[int, int]
    nodes: NodeLayout | None
    batched: bool | None
    head: int
    batch_drop_last: bool
    extra: Any

    def to_json(self) -> dict[str, Any]:
        return {
            "progress": self.progress.to_json(),
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "rank_world": list(self.rank_world),
            "nodes": None if self.nodes is None else self.nodes.to_json(),
            "batched": self.batched,
            "head": self.head,
            "batch_drop_last": self.batch_drop_last,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, got: dict[str, Any]) -> WorkerPlan:
        return cls(
            Progress.from_json(got["progress"]),
            got["batch_size"],
            got["num_workers"],
            (int(got["rank_world"][0]), int(got["rank_world"][1])),
            NodeLayout.from_json(got.get("nodes")),
            got["batched"],
            int(got["head"]),
            bool(got["batch_drop_last"]),
            got["extra"],
        )
