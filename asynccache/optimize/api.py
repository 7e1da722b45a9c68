"""``optimize``: convert ``fn(input)`` over many inputs into a dataset, straight into storage.

The job is cut into shards (contiguous slices of ``inputs``). Ranks take shards
``k % world_size == rank``; within a rank a process pool started from a clean process
(forkserver, else spawn: :func:`pool_context`) takes them one at a time
(:func:`write_shard`). Global rank 0 holds the lease and is the finisher: once every
shard index is in the output, it merges them into ``index.json``, written last
(:func:`merge_shards`). See docs/optimize.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import pickle
import queue
import select
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tqdm import tqdm

from .._version import __version__
from ..config import Settings, launch_env, parse_size
from ..errors import (
    AsyncCacheError,
    BadIndexError,
    ConfigError,
    InputFailedError,
    InputTimeoutError,
    WorkerDiedError,
)
from ..format import INDEX_NAME, Index, merge
from ..format.columns import NAME_RE as SIDECAR_NAME
from ..format.columns import sidecar_name
from ..format.index import index_from_columns
from ..format.items import compressor
from ..format.tokens import token_dtype
from ..storage import Storage
from ..write.writer import MERGE_STALL_S
from . import job as jobs
from . import watch
from .job import JOB_KEY, WORK_PREFIX, Job, Lease, call, chunk_prefix, get_json, shard_key
from .shard import ShardResult, input_name, write_shards
from .staging import sweep_orphans

log = logging.getLogger(__name__)

_POLL_S = (0.05, 2.0)


@dataclasses.dataclass(frozen=True)
class OptimizeResult:
    """What :func:`optimize` produced.

    Attributes:
        url: the output.
        index: the committed ``index.json``.
        inputs: inputs converted by this call (resumed shards not counted).
        items: items written by this call.
        bytes: chunk bytes written by this call.
        skipped: inputs skipped by ``on_error="skip"`` in the whole job.
        errors: the first of those inputs' errors, verbatim.
        resumed_shards: shards finished by an earlier run and skipped.
        seconds: wall time.
    """

    url: str
    index: Index
    inputs: int
    items: int
    bytes: int
    skipped: int
    errors: tuple[str, ...]
    resumed_shards: int
    seconds: float


# -- where this process sits ----------------------------------------------------------


def _world() -> tuple[int, int, Callable[[object], object]]:
    """(rank, world size, broadcast-from-rank-0). torch is imported only when distributed."""
    env = launch_env()
    if env is None and "torch.distributed" not in sys.modules:
        return 0, 1, lambda v: v
    from ..torch import distributed as tdist

    rank, world = tdist.rank_and_world()
    tdist.require_group(rank, world, "optimize")
    return rank, world, tdist.broadcast


# -- the per-shard API: start, write shards anywhere, merge ------------------------


class JobRun:
    """A started job: holds the lease until :meth:`merge` or :meth:`close`.

    ``job`` is picklable; ``todo`` lists the shards still to write (a rerun of an
    interrupted job skips the finished ones).
    """

    def __init__(self, storage: Storage, lease: Lease, job: Job, committed: bool) -> None:
        self.storage, self.lease, self.job = storage, lease, job
        self.committed = committed
        self.index: Index | None = None

    @property
    def todo(self) -> list[int]:
        if self.committed:
            return []
        return [k for k in range(self.job.num_shards) if k not in self.job.done]

    def merge(self, *, stall_s: float = MERGE_STALL_S, world: int = 1) -> Index:
        """Wait for every shard index, then write ``index.json`` (see :func:`merge_shards`)."""
        self.index = merge_shards(
            self.job, lease=self.lease, stall_s=stall_s, storage=self.storage, world=world
        )
        self.committed = True
        return self.index

    def discard(self) -> None:
        """Delete this job's uncommitted files (chunks, shard indexes, plan)."""
        jobs.discard(self.storage, self.job.gen)
        call(self.storage.delete(JOB_KEY))

    def close(self) -> None:
        """Release the lease (files stay: a rerun with the same arguments resumes)."""
        self.lease.release()
        with contextlib.suppress(Exception):
            call(self.storage.close(), 30.0)

    def __enter__(self) -> JobRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_job(
    output_dir: str,
    inputs: Sequence[Any],
    fn: Callable[[Any], Any] | None = None,
    *,
    num_shards: int,
    chunk_bytes: int | str = "64MB",
    compression: str | None = None,
    mode: str = "create",
    on_error: str = "raise",
    storage_options: dict[str, Any] | None = None,
    settings: Settings | None = None,
    tokens: str | None = None,
) -> JobRun:
    """Claim ``output_dir`` and plan (or resume) a job of ``num_shards`` shards.

    The same arguments after a crash resume the unfinished job: ``JobRun.todo`` lists
    only the shards still to write. Hand ``run.job`` and each shard's inputs to
    :func:`write_shard` wherever it runs, then call ``run.merge()`` here.

    Raises:
        WriteConflictError: another live job is converting into ``output_dir``.
        DatasetExistsError: ``mode="create"`` and ``output_dir`` holds a dataset.
        ConfigError: a bad argument.
    """
    size = _check_args(chunk_bytes, compression, mode, on_error)
    tokens = _check_tokens(tokens, compression)
    if num_shards <= 0:
        raise ConfigError(f"num_shards must be > 0, got {num_shards}")
    settings = settings if settings is not None else Settings.from_env()
    aws_env = Settings.aws_env()
    n = len(inputs)
    num_shards = max(1, min(num_shards, n))
    job_for_storage = Job(
        output_dir, "", "", n, num_shards, "", size, compression, mode,
        storage_options=storage_options, settings=settings, aws_env=aws_env,
    )  # fmt: skip
    storage = job_for_storage.open_storage()
    lease = Lease(storage, uuid.uuid4().hex)
    lease.acquire()
    try:
        job, committed = jobs.start(
            storage,
            lease,
            url=output_dir,
            num_inputs=n,
            num_shards=num_shards,
            fp=jobs.fingerprint(inputs, fn, size, compression, mode, tokens),
            chunk_bytes=size,
            compression=compression,
            mode=mode,
            on_error=on_error,
            storage_options=storage_options,
            settings=settings,
            aws_env=aws_env,
            tokens=tokens,
        )
    except BaseException:
        lease.release()
        raise
    return JobRun(storage, lease, job, committed)


def merge_shards(
    job: Job,
    *,
    lease: Lease | None = None,
    stall_s: float = MERGE_STALL_S,
    storage: Storage | None = None,
    world: int = 1,
) -> Index:
    """Wait for all of ``job``'s shard indexes, write ``index.json`` last, clean up.

    The wait is bounded by progress: it fails once no new chunk or shard index appeared
    for ``stall_s`` seconds while shards are missing. With ``world > 1`` (shard ``k``
    written by rank ``k % world``, each beating with :class:`~.job.RankBeat`), a rank
    whose shards are missing and whose heartbeat stopped for ``RANK_TTL_S`` (or whose
    process is gone, on this host) stops the wait at once with :class:`WorkerDiedError`.
    Before the commit the lease is checked (a second job that took the output over makes
    this one stop uncommitted).
    After it, ``_optimize/`` and, for ``overwrite``, the replaced dataset's chunks are
    deleted.

    Raises:
        InputFailedError: a shard on another rank or task reported a failed input.
        CacheError: shards stopped making progress (names them).
        WorkerDiedError: a rank with unfinished shards is gone (names it).
        WriteConflictError: another job took the output over; nothing committed.
    """
    own = storage is None
    storage = storage if storage is not None else job.open_storage()
    try:
        _wait_for_shards(storage, job, stall_s, world)
        parts = call(_read_shards(storage, job))
        if lease is not None:
            lease.check()
        base = jobs.check_current(storage, job)
        index = _merged(job, base, parts)
        if lease is not None:
            lease.check()
        # Version 2: the column sidecar first, then index.json naming it (the commit).
        side, data, text = index.to_columns()
        call(jobs.put_bytes(storage, side, data, job.settings))
        call(jobs.put_bytes(storage, INDEX_NAME, text.encode(), job.settings))
        _clean_after_commit(storage, job, index, side)
        return index_from_columns(text, data, storage.object_url(INDEX_NAME))
    finally:
        if own:
            with contextlib.suppress(Exception):
                call(storage.close(), 30.0)


def _failed_key(job: Job, rank: int) -> str:
    return f"{WORK_PREFIX}/{job.gen}/failed-{rank}.json"


def _wait_for_shards(storage: Storage, job: Job, stall_s: float, world: int = 1) -> None:
    last_marker: Any = None
    last_change = time.monotonic()
    pause = _POLL_S[0]
    peers = jobs.PeerWatch(jobs.RANK_TTL_S) if world > 1 else None
    while True:
        work = call(storage.list(f"{WORK_PREFIX}/{job.gen}/"))
        failed = [o.key for o in work if "/failed-" in o.key]
        if failed:
            _raise_failure(storage, job, failed[0])
        have = {o.key for o in work}
        missing = [k for k in range(job.num_shards) if shard_key(job.gen, k) not in have]
        if not missing:
            return
        if peers is not None:
            _check_ranks(storage, job, world, missing, peers)
        chunks = call(storage.list(chunk_prefix(job.gen)))
        marker = (frozenset(have), frozenset((o.key, o.size) for o in chunks))
        now = time.monotonic()
        if marker != last_marker:
            last_marker, last_change, pause = marker, now, _POLL_S[0]
        elif now - last_change > stall_s:
            from ..errors import CacheError

            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise CacheError(
                f"{job.url}: shards {shown} have not finished and nothing was written for "
                f"{stall_s:.0f}s; their writers are gone (rerun with the same arguments "
                "to resume)"
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])


def _check_ranks(
    storage: Storage, job: Job, world: int, missing: list[int], peers: jobs.PeerWatch
) -> None:
    """Raise WorkerDiedError naming a rank that has shards ``missing`` and is gone."""
    for r in sorted({k % world for k in missing} - {0}):
        why = peers.gone(
            jobs.rank_key(job.gen, r), call(get_json(storage, jobs.rank_key(job.gen, r)))
        )
        if why is None:
            continue
        # it may have written its last shard index just now and stopped beating: look again
        have = {o.key for o in call(storage.list(f"{WORK_PREFIX}/{job.gen}/"))}
        left = [k for k in range(r, job.num_shards, world) if shard_key(job.gen, k) not in have]
        if left:
            raise WorkerDiedError(
                f"{job.url}: rank {r} stopped with shards {', '.join(map(str, left[:10]))} "
                f"unfinished ({why}): it was killed or its node was lost; the finished shards "
                "are kept: rerun with the same arguments to resume"
            )


async def _read_shards(storage: Storage, job: Job) -> list[Index]:
    import asyncio

    gate = asyncio.Semaphore(16)

    async def one(k: int) -> Index:
        async with gate:
            idx = await jobs.read_index(storage, shard_key(job.gen, k))
        if idx is None:
            raise BadIndexError(f"{storage.object_url(shard_key(job.gen, k))}: missing")
        return idx

    return list(await asyncio.gather(*(one(k) for k in range(job.num_shards))))


def _merged(job: Job, base: Index | None, parts: list[Index]) -> Index:
    """Shard indexes (keys 0..n-1 each) renumbered in shard order after ``base``'s items."""
    offset = base.total_items if base is not None else 0
    shifted = [base] if base is not None else []
    inputs = skipped = 0
    errors: list[str] = []
    for part in parts:
        chunks = tuple(
            dataclasses.replace(c, keys=tuple((a + offset, n) for a, n in c.keys))
            for c in part.chunks
        )
        shifted.append(dataclasses.replace(part, chunks=chunks, writer=None, token=None))
        offset += part.total_items
        inputs += int(part.config.get("inputs", 0))
        skipped += int(part.config.get("skipped", 0))
        errors += list(part.config.get("errors", ()))
    if inputs != job.num_inputs:
        raise BadIndexError(
            f"{job.url}: the shards cover {inputs} inputs, the job has {job.num_inputs}"
        )
    config = {
        "chunk_bytes": job.chunk_bytes,
        "chunk_size": None,
        "compression": job.compression,
        "writer": f"asynccache {__version__}",
        "generation": job.gen,
        "skipped_inputs": skipped + int(base.config.get("skipped_inputs", 0) if base else 0),
        "skipped_errors": errors[:20],
    }
    if job.tokens is not None:
        config["token_dtype"] = job.tokens
    try:
        return merge(shifted, config)
    except BadIndexError as exc:
        raise BadIndexError(f"{job.url}: cannot merge shard indexes: {exc}") from exc


def _clean_after_commit(
    storage: Storage, job: Job, index: Index, sidecar: str | None = None
) -> None:
    if sidecar is None and index.mapped:  # a version-2 index read back: its own sidecar
        sidecar = sidecar_name(index.checksum.split(":", 1)[1])
    named = {c.filename for c in index.chunks}
    stale = [o.key for o in call(storage.list(f"{WORK_PREFIX}/{job.gen}/"))]
    # index sidecars no index.json names any more (an earlier commit's)
    stale += [
        o.key
        for o in call(storage.list("index-"))
        if SIDECAR_NAME.match(o.key) and o.key != sidecar
    ]
    # chunks no index names: leftovers of a redone shard, and (overwrite) the old dataset's
    for o in call(storage.list("chunk-")):
        if o.key not in named and (
            job.mode == "overwrite" or o.key.startswith(chunk_prefix(job.gen))
        ):
            stale.append(o.key)
    call(jobs.delete_many(storage, stale))
    call(storage.delete(JOB_KEY))


# -- the driver -------------------------------------------------------------------------


def _check_args(chunk_bytes: int | str, compression: str | None, mode: str, on_error: str) -> int:
    if mode not in jobs.MODES:
        raise ConfigError(f"mode must be one of {', '.join(jobs.MODES)}, got {mode!r}")
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    try:
        size = parse_size(chunk_bytes) if isinstance(chunk_bytes, str) else int(chunk_bytes)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"chunk_bytes={chunk_bytes!r} is not a size") from exc
    if size <= 0:
        raise ConfigError(f"chunk_bytes must be > 0, got {chunk_bytes!r}")
    if compression is not None:
        compressor(compression)  # fails now, naming the codec
    return size


def _check_tokens(tokens: str | None, compression: str | None) -> str | None:
    """The token dtype's name (``"uint16"``), or None for a dataset of items."""
    if tokens is None:
        return None
    if compression is not None:
        raise ConfigError("tokens= and compression= can't be combined (tokens are mapped)")
    return token_dtype(tokens).name


_worker_queue: Any = None
#: Modules the fork server imports once, so each worker it forks starts warm.
_PRELOAD = ["__main__", "asynccache.optimize.api"]


def pool_context() -> Any:
    """The multiprocessing context of the worker pool: ``forkserver``, else ``spawn``.

    Both start workers from a clean process, never from the caller (whose threads, locks
    and I/O loop must not be forked), so ``fn`` must be picklable and the caller's script
    guarded by ``if __name__ == "__main__"``, as with ``spawn``. The fork server imports
    asynccache once per calling process (not torch: the package binds its torch-facing
    names on first use); later pools fork from it, so a worker starts in milliseconds.
    Modules the caller asked the fork server to preload before are kept.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # Added to what the caller (or an earlier pool) asked the server to preload, never in
    # its place: the process has one fork server, and the list in force when it starts is
    # the one it keeps. Ignored once a server runs.
    ctx.set_forkserver_preload(_with_ours(_forkserver_preload()))
    return ctx


def _forkserver_preload() -> list[str]:
    """The preload list the process's fork server would start with now."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return list(getattr(server, "_preload_modules", None) or [])


def _with_ours(modules: list[str]) -> list[str]:
    return modules + [m for m in _PRELOAD if m not in modules]


def _init_worker(q: Any, slots: Any, counter: Any, driver: int) -> None:
    global _worker_queue
    _worker_queue = q
    watch.claim_slot(slots, counter)
    threading.Thread(
        target=_exit_with, args=(driver,), name="asynccache-driver-watch", daemon=True
    ).start()


def _exit_with(driver: int) -> None:
    """End this worker once the driver process is gone (killed outright, say).

    A pool worker otherwise outlives it: it finishes its shards for nobody, then waits
    for a next task forever. A pidfd (readable when that very process exits, whatever
    reuses its pid) where the platform has one, else a check every second.
    """
    try:
        fd = os.pidfd_open(driver)
    except (AttributeError, OSError):  # no pidfd here, or the driver is gone already
        while jobs.pid_alive(driver):
            time.sleep(1.0)
    else:
        select.select([fd], [], [])
    os._exit(70)  # (EX_SOFTWARE) its staging directory is swept by the next worker there


def _ready() -> int:
    return os.getpid()


def _report(inputs: int, items: int, nbytes: int) -> None:
    if _worker_queue is not None:
        with contextlib.suppress(Exception):
            _worker_queue.put_nowait((inputs, items, nbytes))


def _shard_task(
    job: Job,
    fn: Callable[[Any], Any],
    bundle: list[tuple[int, Sequence[Any]]],
    staging: str | None,
) -> list[ShardResult]:
    return write_shards(job, fn, bundle, staging_dir=staging, progress=_report)


class _Bar:
    def __init__(self, total: int, url: str, show: bool) -> None:
        self.bar = tqdm(total=total, unit="input", desc=f"optimize {url}", disable=not show)
        self.items = self.bytes = 0
        self.t0 = time.monotonic()

    def update(self, inputs: int, items: int, nbytes: int) -> None:
        self.items += items
        self.bytes += nbytes
        dt = max(time.monotonic() - self.t0, 1e-9)
        self.bar.set_postfix_str(
            f"{self.items} items, {self.items / dt:.0f} items/s, {self.bytes / 2**20:.1f} MiB",
            refresh=False,
        )
        self.bar.update(inputs)

    def close(self) -> None:
        self.bar.close()


class _Workers:
    """This node's worker pool, started before the job is planned.

    Its processes start (forked from the fork server, or spawned) while the lease settles
    and the plan is read or written, not after: the pool's start overlaps the job's own.
    Each worker takes a slot of the input clock (:mod:`.watch`) that the driver reads to
    enforce ``input_timeout_s``.
    """

    def __init__(self, num_workers: int, staging_dir: str | None) -> None:
        self.num_workers = num_workers
        self.staging = staging_dir
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        if num_workers == 0:
            return
        ctx = pool_context()
        self.q = ctx.Queue()
        self.slots = ctx.RawArray("d", [watch.IDLE, 0.0] * num_workers)
        counter = ctx.Value("i", 0)
        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(self.q, self.slots, counter, os.getpid()),
        )
        for _ in range(num_workers):  # start them all now (each submit starts one)
            self.pool.submit(_ready)

    def kill(self) -> None:
        """Stop every worker now (SIGKILL: a hung ``fn`` may ignore SIGTERM), mid-shard."""
        if self.pool is not None:
            for p in list(getattr(self.pool, "_processes", {}).values()):
                with contextlib.suppress(Exception):
                    p.kill()

    def close(self, ok: bool) -> None:
        """Stop the pool, killing its workers at once unless ``ok``."""
        if self.pool is not None:
            if not ok:  # stop the other workers now rather than after their shards
                self.kill()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.q.close()
            self.q.join_thread()
            if not ok:  # the staging directories of the workers just killed
                sweep_orphans(self.staging or tempfile.gettempdir())


def _run_shards(
    job: Job,
    fn: Callable[[Any], Any],
    inputs: Sequence[Any],
    shards: list[int],
    workers: _Workers,
    bar: _Bar,
    input_timeout_s: float | None = None,
) -> list[ShardResult]:
    """Write ``shards`` here: inline for ``num_workers == 0``, else on ``workers``' pool.

    Each task is a run of consecutive shards (about two tasks per worker), written
    pipelined (:func:`write_shards`): a shard's last uploads overlap the next shard's
    ``fn``; the split keeps some load balancing between workers. The wait for the workers
    is bounded by their lives (a dead one breaks the pool) and, with ``input_timeout_s``,
    by each input's time in ``fn``.
    """

    def part(k: int) -> tuple[int, Sequence[Any]]:
        a, b = job.bounds(k)
        return k, inputs[a:b]

    if workers.pool is None:
        return write_shards(
            job, fn, [part(k) for k in shards], staging_dir=workers.staging, progress=bar.update
        )
    num_workers, pool = workers.num_workers, workers.pool
    per_task = max(1, -(-len(shards) // (2 * num_workers)))
    todo = [shards[i : i + per_task] for i in range(0, len(shards), per_task)]
    results: list[ShardResult] = []
    pending: set[concurrent.futures.Future[list[ShardResult]]] = set()
    try:
        while todo or pending:
            while todo and len(pending) < 2 * num_workers:  # bounded: inputs are pickled
                bundle = [part(k) for k in todo.pop(0)]
                pending.add(pool.submit(_shard_task, job, fn, bundle, workers.staging))
            done, pending = concurrent.futures.wait(
                pending, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED
            )
            _drain(workers.q, bar)
            for f in done:
                try:
                    results += f.result()
                except concurrent.futures.process.BrokenProcessPool as exc:
                    raise WorkerDiedError(
                        f"{job.url}: a worker process died (killed or out of memory); the "
                        "finished shards are kept: rerun with the same arguments to resume"
                    ) from exc
            if input_timeout_s is not None:
                late = watch.overdue(workers.slots, input_timeout_s)
                if late is not None:
                    raise _timed_out(job, inputs, shards, late[0], input_timeout_s)
    except BaseException:
        workers.kill()  # before the caller cleans up: no worker may write after that
        raise
    _drain(workers.q, bar)
    return results


def _timed_out(
    job: Job, inputs: Sequence[Any], shards: list[int], i: int, limit_s: float
) -> InputTimeoutError:
    shard = next((k for k in shards if job.bounds(k)[0] <= i < job.bounds(k)[1]), None)
    return InputTimeoutError(
        f"{job.url}: fn ran for more than {limit_s:g}s on {input_name(i, inputs[i])} in shard "
        f"{shard} (input_timeout_s={limit_s:g}); its worker was stopped; the finished shards "
        "are kept: rerun with the same arguments to resume"
    )


def _drain(q: Any, bar: _Bar) -> None:
    while True:
        try:
            bar.update(*q.get_nowait())
        except queue.Empty:
            return


def optimize(
    fn: Callable[[Any], Any],
    inputs: Sequence[Any] | Iterable[Any],
    output_dir: str,
    *,
    num_workers: int | None = None,
    chunk_bytes: int | str = "64MB",
    compression: str | None = None,
    mode: str = "create",
    storage_options: dict[str, Any] | None = None,
    on_error: str = "raise",
    num_shards: int | None = None,
    staging_dir: str | None = None,
    settings: Settings | None = None,
    tokens: str | None = None,
    input_timeout_s: float | None = None,
) -> OptimizeResult:
    """Convert ``fn(x) for x in inputs`` into a dataset at ``output_dir``; ``index.json`` last.

    Args:
        fn: ``fn(input)`` returns one item, yields several, or returns None (nothing).
            A module-level function (it is pickled to spawned worker processes).
        inputs: a sequence (anything else is made a list first). Its ``repr`` per item
            identifies the job for resuming.
        output_dir: ``s3://bucket/prefix``, a directory or any storage URL that takes writes.
        num_workers: worker processes on this node (default: CPU count); 0 runs inline.
        chunk_bytes: chunk size (``"64MB"``, or bytes).
        compression: per-item compression (``"zstd"``), or None.
        mode: ``"create"`` (fail if a dataset is there), ``"overwrite"`` (replace it; a
            reader never sees a mix) or ``"append"`` (items after the existing ones; a new
            dataset identity).
        storage_options: backend options (docs/storage.md).
        on_error: ``"raise"`` stops the job, naming the input, and deletes what it wrote;
            ``"skip"`` leaves failing inputs out, counted in the result.
        num_shards: resume and load-balancing unit (default: 4 per worker over all ranks,
            at least one per 100k inputs).
        staging_dir: where closed chunks wait for upload (default: the temp directory).
        settings: tuning; default ``Settings.from_env()``; ``progress=False`` hides the bar.
        tokens: write a token dataset (docs/tokens.md): every item ``fn`` gives is a
            document, a 1-D integer array stored as raw tokens of this dtype
            (``"uint16"``, ``"int32"``, ...); read it with ``TokenBlocks``.
        input_timeout_s: stop the job with InputTimeoutError (naming the input and its
            shard) when ``fn`` runs longer than this on one input (all its items; waits
            for storage not counted); its worker is killed, finished shards are kept.
            None (default): no limit. Needs ``num_workers >= 1``.

    Under ``torchrun`` (an initialised process group), every rank calls it with the same
    arguments; rank 0 commits, and every rank returns once ``index.json`` is written.

    Raises:
        InputFailedError: ``fn`` raised on an input (named) with ``on_error="raise"``.
        InputTimeoutError: ``fn`` ran past ``input_timeout_s`` on an input (named); a
            rerun resumes.
        WorkerDiedError: a worker process died; a rerun resumes.
        WriteConflictError: another job is converting into ``output_dir``.
        DatasetExistsError: ``mode="create"`` and a dataset is already there.
        ConfigError: a bad argument.
    """
    started = time.monotonic()
    if not isinstance(inputs, Sequence):
        inputs = list(inputs)
    size = _check_args(chunk_bytes, compression, mode, on_error)
    if num_workers is None:
        num_workers = multiprocessing.cpu_count()
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
    if num_workers > 0:
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise ConfigError(
                f"fn {fn!r} cannot be sent to worker processes ({exc}); define it at module "
                "level, or pass num_workers=0"
            ) from exc
    _check_timeout(input_timeout_s, num_workers)
    settings = settings if settings is not None else Settings.from_env()
    rank, world, broadcast = _world()
    n = len(inputs)
    if num_shards is None:
        num_shards = max(4 * max(1, num_workers) * world, -(-n // 100_000))
    # The pool starts now, while the lease settles and the plan is made.
    ours = -(-(max(1, min(num_shards, n)) - rank) // world)
    workers = _Workers(min(num_workers, max(1, ours)), staging_dir)
    ok = False
    try:
        result = _optimize(
            fn, inputs, output_dir, workers, num_shards=num_shards, size=size,
            compression=compression, mode=mode, storage_options=storage_options,
            on_error=on_error, settings=settings, tokens=tokens, rank=rank, world=world,
            broadcast=broadcast, input_timeout_s=input_timeout_s,
        )  # fmt: skip
        ok = True
    finally:
        workers.close(ok)
    return dataclasses.replace(result, seconds=time.monotonic() - started)


def _check_timeout(input_timeout_s: float | None, num_workers: int) -> None:
    if input_timeout_s is None:
        return
    if not (isinstance(input_timeout_s, (int, float)) and 0 < input_timeout_s < float("inf")):
        raise ConfigError(
            f"input_timeout_s must be a number of seconds > 0, got {input_timeout_s!r}"
        )
    if num_workers == 0:
        raise ConfigError(
            "input_timeout_s needs num_workers >= 1: a hung fn is stopped by ending its "
            "worker process, and num_workers=0 runs fn in this one"
        )


def _optimize(
    fn: Callable[[Any], Any],
    inputs: Sequence[Any],
    output_dir: str,
    workers: _Workers,
    *,
    num_shards: int,
    size: int,
    compression: str | None,
    mode: str,
    storage_options: dict[str, Any] | None,
    on_error: str,
    settings: Settings,
    tokens: str | None,
    rank: int,
    world: int,
    broadcast: Callable[[object], object],
    input_timeout_s: float | None,
) -> OptimizeResult:
    run: JobRun | None = None
    shipped: Any
    if rank == 0:
        try:
            run = start_job(
                output_dir, inputs, fn, num_shards=num_shards, chunk_bytes=size,
                compression=compression, mode=mode, on_error=on_error,
                storage_options=storage_options, settings=settings, tokens=tokens,
            )  # fmt: skip
            shipped = dataclasses.replace(run.job, settings=Settings(), aws_env={})
            shipped = (shipped, run.committed)
        except BaseException as exc:
            if world > 1:  # the other ranks wait in the broadcast: tell them
                err = exc if isinstance(exc, AsyncCacheError) else AsyncCacheError(repr(exc))
                broadcast(err)
            raise
        broadcast(shipped)
    else:
        shipped = broadcast(None)
        if isinstance(shipped, BaseException):
            raise shipped
    job0, committed = shipped
    job: Job = dataclasses.replace(
        job0, settings=settings, aws_env=Settings.aws_env(), storage_options=storage_options
    )
    mine = (
        []
        if committed
        else [k for k in range(job.num_shards) if k % world == rank and k not in job.done]
    )
    total = sum(job.bounds(k)[1] - job.bounds(k)[0] for k in mine)
    bar = _Bar(total, output_dir, settings.progress and sys.stderr.isatty())
    results: list[ShardResult] = []
    beat = _start_beat(job, rank) if world > 1 and rank != 0 and mine else None
    try:
        try:
            results = _run_shards(job, fn, inputs, mine, workers, bar, input_timeout_s)
        finally:
            if beat is not None:
                beat.stop()
    except InputTimeoutError as exc:  # (not discarded: the hang may pass; a rerun resumes)
        bar.close()
        if world > 1:
            with contextlib.suppress(Exception):
                _post_failure(job, rank, str(exc), "timeout")
        if run is not None:
            run.close()
        raise
    except InputFailedError as exc:
        bar.close()
        if run is not None:
            run.discard()
            run.close()
        else:
            _post_failure(job, rank, str(exc), "input")
        raise
    except BaseException as exc:
        bar.close()
        if world > 1:  # the other ranks would wait for this one's shards: tell them
            with contextlib.suppress(Exception):
                _post_failure(job, rank, f"{type(exc).__name__}: {exc}", "stopped")
        if run is not None:
            run.close()  # files stay: a rerun resumes
        raise
    bar.close()
    if run is not None:
        try:
            if committed:  # an earlier run committed, then stopped before its cleanup
                index = _read_committed(run.storage)
                _clean_after_commit(run.storage, job, index)
            else:
                index = run.merge(world=world)
        except InputTimeoutError:  # another rank's fn hung: its finished shards are kept
            raise
        except InputFailedError:
            run.discard()
            raise
        except BaseException as exc:
            if world > 1:  # the other ranks wait for the commit: tell them
                with contextlib.suppress(Exception):
                    _post_failure(job, rank, f"{type(exc).__name__}: {exc}", "stopped")
            raise
        finally:
            run.close()
    else:
        index = _wait_for_commit(job)
    return OptimizeResult(
        url=output_dir,
        index=index,
        inputs=sum(r.inputs for r in results),
        items=sum(r.items for r in results),
        bytes=sum(r.bytes for r in results),
        skipped=int(index.config.get("skipped_inputs", 0)),
        errors=tuple(index.config.get("skipped_errors", ())),
        resumed_shards=len(job.done),
        seconds=0.0,
    )


class _Beat:
    """A rank's heartbeat (:class:`~.job.RankBeat`) on a storage connection of its own."""

    def __init__(self, job: Job, rank: int) -> None:
        self.storage = job.open_storage()
        self.beat = jobs.RankBeat(self.storage, job.gen, rank)
        try:
            self.beat.start()
        except BaseException:
            self.close()
            raise

    def stop(self) -> None:
        try:
            self.beat.stop()
        finally:
            self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            call(self.storage.close(), 30.0)


def _start_beat(job: Job, rank: int) -> _Beat:
    return _Beat(job, rank)


def _read_committed(storage: Storage) -> Index:
    idx = call(jobs.read_index(storage))
    if idx is None:
        raise BadIndexError(f"{storage.url}: index.json vanished")
    return idx


def _post_failure(job: Job, rank: int, message: str, kind: str) -> None:
    """Tell the other ranks this rank stopped: ``kind`` "input" (fn failed), "timeout" (fn
    ran past ``input_timeout_s``) or "stopped"."""
    storage = job.open_storage()
    doc = {"error": message, "kind": kind, "rank": rank}
    try:
        call(jobs.put_bytes(storage, _failed_key(job, rank), json.dumps(doc).encode()))
    finally:
        with contextlib.suppress(Exception):
            call(storage.close(), 30.0)


def _raise_failure(storage: Storage, job: Job, key: str) -> None:
    """Raise what the rank that posted ``key`` stopped with."""
    doc = call(get_json(storage, key)) or {}
    message = str(doc.get("error", f"{storage.object_url(key)}: a rank stopped"))
    if doc.get("kind", "input") == "input":
        raise InputFailedError(message)
    if doc.get("kind") == "timeout":
        raise InputTimeoutError(message)
    raise WorkerDiedError(
        f"{job.url}: rank {doc.get('rank')} stopped ({message}); the finished shards are "
        "kept: rerun with the same arguments to resume"
    )


def _wait_for_commit(job: Job, stall_s: float = MERGE_STALL_S) -> Index:
    """Other ranks: wait until rank 0 committed this job.

    Bounded by the job's progress, and by rank 0's lease: once it no longer names this
    job's owner, or its heartbeat stopped for ``LEASE_TTL_S`` (at once when rank 0's
    process on this host is gone), rank 0 is gone and this raises WorkerDiedError.
    """
    storage = job.open_storage()
    finisher = jobs.PeerWatch(jobs.LEASE_TTL_S)
    try:
        last: Any = None
        last_change = time.monotonic()
        pause = _POLL_S[0]
        while True:
            idx = call(jobs.read_index(storage))
            if idx is not None and idx.config.get("generation") == job.gen:
                return idx
            work = call(storage.list(f"{WORK_PREFIX}/"))
            failed = [o.key for o in work if o.key.startswith(f"{WORK_PREFIX}/{job.gen}/failed-")]
            if failed:
                _raise_failure(storage, job, failed[0])
            plan = call(get_json(storage, JOB_KEY)) if any(o.key == JOB_KEY for o in work) else None
            if plan is None or plan.get("gen") != job.gen:
                idx = call(jobs.read_index(storage))  # committed just now, or given up
                if idx is not None and idx.config.get("generation") == job.gen:
                    return idx
                raise InputFailedError(
                    f"{job.url}: rank 0 stopped job {job.gen} without committing (an input "
                    "failed there, or it was interrupted); see rank 0's error"
                )
            lease = call(get_json(storage, jobs.LEASE_KEY))
            if lease is None or lease.get("owner") != job.owner or lease.get("released"):
                why: str | None = "it no longer holds the output's lease"
            else:
                why = finisher.gone(jobs.LEASE_KEY, lease)
            if why is not None:
                idx = call(jobs.read_index(storage))  # committed just before letting go?
                if idx is not None and idx.config.get("generation") == job.gen:
                    return idx
                raise WorkerDiedError(
                    f"{job.url}: rank 0 stopped without committing job {job.gen} ({why}); "
                    "the finished shards are kept: rerun with the same arguments to resume"
                )
            marker = frozenset((o.key, o.size) for o in work)
            now = time.monotonic()
            if marker != last:
                last, last_change, pause = marker, now, _POLL_S[0]
            elif now - last_change > stall_s:
                from ..errors import CacheError

                raise CacheError(
                    f"{job.url}: rank 0 has not committed job {job.gen} and nothing changed "
                    f"for {stall_s:.0f}s"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
    finally:
        with contextlib.suppress(Exception):
            call(storage.close(), 30.0)
