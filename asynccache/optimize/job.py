"""One conversion job in the output: its plan, its lease, and the names it writes.

Everything a job writes lives at the output root (a bucket prefix or a directory); no
shared file system is involved, only the storage contract (put, list, head, delete)::

    index.json                              the commit, written last by the finisher
    chunk-<gen>-<shard>-<n>.bin             chunks; <gen> is new for every job
    _optimize/lease.json                    the running job: owner token, pid, host, beat count
    _optimize/job.json                      the plan: gen, shard count, input fingerprint
    _optimize/<gen>/shard-<k>.index.json    one per finished shard: its chunks, keys 0..n-1

Invariants:

* A chunk name is never reused across jobs (``<gen>`` is random), so overwriting or
  appending never changes bytes that an ``index.json`` already names.
* ``_optimize/<gen>/shard-<k>.index.json`` is written only after every chunk it names is
  stored: its presence means shard ``k`` is finished, and a rerun skips it.
* ``index.json`` is written after every shard index is read back; only then are
  ``_optimize/`` and superseded chunks deleted.

Layer: storage, format, errors; used by the optimize driver and the per-shard API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

from ..bridge import get_loop_thread
from ..bridge.lifeline import pid_alive
from ..cache import indexfile, stamp
from ..cache.fsutil import fsync_dir, publishing
from ..config import Settings
from ..download.retry import RetryPolicy
from ..errors import ObjectNotFoundError, StorageTimeoutError, TransientError, WriteConflictError
from ..format import INDEX_NAME, Index
from ..storage import Storage, open_storage
from ..storage.local import TEMP_PREFIX

log = logging.getLogger(__name__)

WORK_PREFIX = "_optimize"
LEASE_KEY = f"{WORK_PREFIX}/lease.json"
JOB_KEY = f"{WORK_PREFIX}/job.json"
MODES = ("create", "overwrite", "append")
#: A foreign lease that did not change for this long, on the contender's own monotonic
#: clock, is stale: its job is gone (the holder rewrites it every twelfth of this).
LEASE_TTL_S = 60.0
#: How long a new lease waits before reading it back (a racing job's write lands first).
LEASE_SETTLE_S = 0.25
#: The same for a local output: a write there is visible to every reader once it returns.
LOCAL_SETTLE_S = 0.02
#: Outer bound on one storage call from sync code; each request has its own timeouts.
IO_BOUND_S = 3600.0
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


def chunk_name(gen: str, shard: int, n: int) -> str:
    return f"chunk-{gen}-{shard}-{n}.bin"


def chunk_prefix(gen: str) -> str:
    return f"chunk-{gen}-"


def shard_key(gen: str, shard: int) -> str:
    return f"{WORK_PREFIX}/{gen}/shard-{shard:06d}.index.json"


def call(coro: Any, timeout: float = IO_BOUND_S, what: str | None = None) -> Any:
    """Run a storage coroutine on this process's I/O thread and wait at most ``timeout``.

    Past the bound the coroutine is cancelled and StorageTimeoutError raised, naming
    ``what`` (the object being stored) when given.
    """
    loop = get_loop_thread()
    if what is None:
        return loop.call(coro, timeout)
    fut = loop.submit(coro)
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError as exc:
        if fut.done():  # the coroutine's own error (it may be a TimeoutError too)
            raise
        fut.cancel()
        raise StorageTimeoutError(f"{what}: did not finish within {timeout:.0f}s") from exc


async def upload_retried(storage: Storage, src: str, key: str, settings: Settings) -> int:
    """``storage.upload`` with the settings' retry budget for transient failures.

    The storage contract's ``upload`` does not retry; a conversion of millions of objects
    meets a 503 or a reset now and then. A PUT of the same bytes twice is harmless.
    """
    policy = RetryPolicy(settings.retries, settings.backoff_base_s, settings.backoff_max_s)
    failures = 0
    while True:
        try:
            return await storage.upload(src, key)
        except TransientError as exc:
            failures += 1
            if not policy.should_retry(failures):
                raise
            wait = policy.delay(failures, getattr(exc, "retry_after", None))
            log.info("%s: retrying upload in %.1fs: %s", storage.object_url(key), wait, exc)
            await asyncio.sleep(wait)


async def put_bytes(
    storage: Storage, key: str, data: bytes, settings: Settings | None = None
) -> None:
    """Store ``data`` as ``key`` (whole object; atomic on every backend), with retries.

    A local output gets it directly (temp file beside it, fsync unless
    ``ASYNCCACHE_DURABLE=0``, rename, directory fsync): no staging copy, and a
    published shard index or ``index.json`` survives a power loss.
    """
    settings = settings or Settings()
    path = storage.local_path(key)
    if path is not None:
        await asyncio.to_thread(_put_local, path, data, settings.durable)
        return
    if hasattr(os, "memfd_create"):  # no file to leave behind, even if killed meanwhile
        fd = os.memfd_create("asynccache-put", os.MFD_CLOEXEC)
        try:
            _write_all(fd, data)
            await upload_retried(storage, f"/proc/self/fd/{fd}", key, settings)
        finally:
            os.close(fd)
        return
    fd, tmp = tempfile.mkstemp(prefix="asynccache-put-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        await upload_retried(storage, tmp, key, settings)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


def write_file(
    path: str,
    pieces: Iterable[bytes | memoryview],
    *,
    fsync: bool = False,
    hasher: Any = None,
    writeback: bool = False,
) -> int:
    """Write ``pieces`` to a temp file beside ``path`` (hidden from listings), rename it in.

    The pieces go to the kernel in ``writev`` batches, straight from the callers' buffers
    (no copy in user space). ``hasher`` (if given) sees every piece. ``fsync``: flushed to
    disk before the rename. ``writeback``: the kernel starts writing the file back now,
    without waiting (:func:`sync_files` later waits for it); the caller must fsync it
    before anything durable names it.

    Raises:
        CacheError: the disk is full or the directory is not writable (names ``path``).
    """
    head, tail = os.path.split(path)
    tmp = os.path.join(head, f"{TEMP_PREFIX}{tail}.{os.getpid()}.{secrets.token_hex(4)}")
    n = 0
    with publishing(tmp, path):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            batch: list[bytes | memoryview] = []
            for piece in pieces:
                if hasher is not None:
                    hasher.update(piece)
                batch.append(piece)
                if len(batch) == _IOV_MAX:
                    n += _writev(fd, batch)
                    batch = []
            if batch:
                n += _writev(fd, batch)
            if fsync:
                os.fsync(fd)
            elif writeback and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # starts async writeback
        finally:
            os.close(fd)
        os.replace(tmp, path)
    return n


def _writev(fd: int, pieces: list[bytes | memoryview]) -> int:
    total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
    done = os.writev(fd, pieces)
    if done < total:  # a short write (rare on files): finish piece by piece
        skip = done
        for p in pieces:
            view = memoryview(p).cast("B")
            if skip >= view.nbytes:
                skip -= view.nbytes
                continue
            view, skip = view[skip:], 0
            while view.nbytes:
                view = view[os.write(fd, view) :]
    return total


def sync_files(paths: Sequence[str]) -> None:
    """fsync ``paths`` (already renamed into place), then their directories."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for directory in {os.path.dirname(p) for p in paths}:
        fsync_dir(directory)


def _put_local(path: str, data: bytes, durable: bool) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_file(path, [data], fsync=durable)
    if durable:
        fsync_dir(os.path.dirname(path))


async def get_json(storage: Storage, key: str) -> dict[str, Any] | None:
    """The JSON object stored as ``key``, or None when absent or not a JSON object."""
    try:
        data = await storage.read(key)
    except ObjectNotFoundError:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


async def read_index(storage: Storage, key: str = INDEX_NAME) -> Index | None:
    """The parsed ``key`` (an index of either version), or None when absent."""
    return await indexfile.read_storage(storage, key)


async def delete_many(storage: Storage, keys: Sequence[str]) -> None:
    gate = asyncio.Semaphore(16)

    async def one(key: str) -> None:
        async with gate:
            await storage.delete(key)

    await asyncio.gather(*(one(k) for k in keys))


def fingerprint(
    inputs: Sequence[Any],
    fn: Any,
    chunk_bytes: int,
    compression: str | None,
    mode: str,
    tokens: str | None = None,
) -> str:
    """A checksum of what defines the job: same arguments, same fingerprint.

    Inputs enter through ``repr``: inputs whose ``repr`` changes from run to run (objects
    without one) make every rerun a new job instead of a resume.
    """
    h = xxhash.xxh3_64()
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    args: list[Any] = [len(inputs), name, chunk_bytes, compression, mode]
    if tokens is not None:  # (jobs of items keep the fingerprint they always had)
        args.append(tokens)
    h.update(json.dumps(args).encode())
    for x in inputs:
        h.update(repr(x).encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Job:
    """The plan of one conversion, shared by the driver, the workers and the finisher.

    Picklable: it travels to worker processes (and to Ray/Dask/Spark tasks). Holds no
    connection; each process opens its own storage from ``url`` and ``storage_options``.
    """

    url: str
    gen: str
    owner: str
    num_inputs: int
    num_shards: int
    fingerprint: str
    chunk_bytes: int
    compression: str | None
    mode: str
    on_error: str = "raise"
    #: The checksum of the index ``append`` extends (None otherwise).
    base_checksum: str | None = None
    storage_options: Mapping[str, Any] | None = None
    settings: Settings = dataclasses.field(default_factory=Settings, repr=False)
    aws_env: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    #: Shards finished by an earlier, interrupted run of this job (skipped).
    done: frozenset[int] = frozenset()
    #: The token dtype name of a token dataset (docs/tokens.md); None: items.
    tokens: str | None = None

    def bounds(self, shard: int) -> tuple[int, int]:
        """``(start, stop)``: shard ``shard`` converts ``inputs[start:stop]``."""
        n, s = self.num_inputs, self.num_shards
        return shard * n // s, (shard + 1) * n // s

    def open_storage(self) -> Storage:
        return open_storage(self.url, self.settings, self.storage_options, self.aws_env)

    def plan_doc(self) -> dict[str, Any]:
        return {
            "gen": self.gen,
            "num_inputs": self.num_inputs,
            "num_shards": self.num_shards,
            "fingerprint": self.fingerprint,
            "chunk_bytes": self.chunk_bytes,
            "compression": self.compression,
            "mode": self.mode,
            "base_checksum": self.base_checksum,
            "tokens": self.tokens,
        }


# -- the lease ----------------------------------------------------------------------


def this_host() -> dict[str, Any]:
    """Who writes a heartbeat: hostname and boot id (pids are only comparable on one
    kernel and in one pid namespace, so both must match; see :func:`same_host`)."""
    boot = stamp.boot_id()
    return {"host": socket.gethostname(), "boot": None if boot is None else boot.decode()}


def same_host(doc: Mapping[str, Any]) -> bool:
    """True when ``doc`` was written on this host (same hostname and boot), so its pid can
    be checked here. A document without a boot id never counts as this host's."""
    me = this_host()
    return (
        me["boot"] is not None and doc.get("boot") == me["boot"] and doc.get("host") == me["host"]
    )


def lease_is_dead(doc: Mapping[str, Any]) -> str | None:
    """Why the job that wrote lease ``doc`` is certainly gone (released, or its pid on
    this host no longer exists), or None when only watching the lease can tell."""
    if doc.get("released"):
        return "released"
    pid = doc.get("pid")
    if same_host(doc) and isinstance(pid, int) and not pid_alive(pid):
        return f"its process (pid {pid} on this host) is gone"
    return None


def _describe(doc: Mapping[str, Any]) -> str:
    beat = doc.get("heartbeat")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC by its host's clock", time.gmtime(beat))
        if isinstance(beat, (int, float)) and not isinstance(beat, bool) and 0 <= beat < 1e11
        else "never"
    )
    return f"job {doc.get('owner')} (pid {doc.get('pid')} on {doc.get('host')}, heartbeat {when})"


class Lease:
    """This job's claim on the output: ``_optimize/lease.json`` holding our owner token.

    Object stores offer no atomic create-if-absent through our storage contract, so the
    claim is: read (refuse a live foreign lease), write ours, wait ``settle_s``, read back
    (refuse when another job's write replaced ours). A heartbeat thread rewrites it every
    ``ttl_s / 12`` (a new ``beat`` count each time) after checking it is still ours, and
    :meth:`check` is called right before the commit: of two jobs racing on one output, at
    most one writes ``index.json``; the other raises :class:`WriteConflictError`.

    Liveness never compares wall clocks: hosts' clocks differ, and a contender whose clock
    runs ahead would see a live job's fresh heartbeat as old. A foreign lease is live while
    it *changes*: the contender reads it again every ``ttl_s / 48`` for up to ``ttl_s`` of
    its own monotonic clock, refuses at the first change, and takes over only a lease that
    stayed the same for the whole period (or one that is certainly dead:
    :func:`lease_is_dead`). The heartbeat's wall time is kept for messages only.
    """

    def __init__(self, storage: Storage, owner: str, ttl_s: float = LEASE_TTL_S) -> None:
        self.storage, self.owner, self.ttl_s = storage, owner, ttl_s
        self.beat_s = ttl_s / 12
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0

    def _doc(self, released: bool = False) -> bytes:
        self._beats += 1
        doc = {
            "owner": self.owner,
            "pid": os.getpid(),
            **this_host(),
            "heartbeat": time.time(),
            "beat": self._beats,
            "released": released,
        }
        return json.dumps(doc).encode()

    def acquire(self, settle_s: float = LEASE_SETTLE_S) -> None:
        """Claim the output. Raises WriteConflictError naming the other job.

        Bounded: a foreign lease is watched for at most ``ttl_s`` (plus one read).
        """
        where = self.storage.url
        doc = call(get_json(self.storage, LEASE_KEY))
        if doc is not None and doc.get("owner") != self.owner:
            self._wait_out(doc)
        call(put_bytes(self.storage, LEASE_KEY, self._doc()))
        if self.storage.local_path(LEASE_KEY) is not None:
            settle_s = min(settle_s, LOCAL_SETTLE_S)
        time.sleep(settle_s)
        self.check()
        log.debug("%s: lease taken by %s", where, self.owner)
        self._thread = threading.Thread(target=self._beat, name="asynccache-lease", daemon=True)
        self._thread.start()

    def _wait_out(self, doc: dict[str, Any]) -> None:
        """Return once foreign lease ``doc`` is gone, dead or unchanged for ``ttl_s``;
        raise WriteConflictError as soon as it changes (its job is alive)."""
        where = self.storage.url
        if lease_is_dead(doc) is not None:
            return
        log.info(
            "%s: %s holds the lease; watching it for up to %.0fs to tell whether it is alive",
            where, _describe(doc), self.ttl_s,
        )  # fmt: skip
        since = time.monotonic()
        while (waited := time.monotonic() - since) < self.ttl_s:
            time.sleep(min(self.ttl_s / 48, self.ttl_s - waited))
            now = call(get_json(self.storage, LEASE_KEY))
            if now is None or lease_is_dead(now) is not None:
                return
            if now != doc:
                raise WriteConflictError(
                    f"{where}: {_describe(now)} is converting a dataset into this output "
                    f"(its lease changed within {time.monotonic() - since:.1f}s); wait for "
                    f"it, or if it died on another host, rerun: a lease unchanged for "
                    f"{self.ttl_s:.0f}s is taken over"
                )
        log.warning(
            "%s: taking over the stale lease of %s (unchanged for %.0fs)",
            where, _describe(doc), self.ttl_s,
        )  # fmt: skip

    def check(self) -> None:
        """Raise WriteConflictError unless the lease still names this job."""
        if self.lost is not None:
            raise WriteConflictError(self.lost)
        doc = call(get_json(self.storage, LEASE_KEY))
        if doc is None or doc.get("owner") != self.owner:
            who = _describe(doc) if doc else "another job (lease removed)"
            self.lost = (
                f"{self.storage.url}: {who} started converting into this output while this "
                "job ran; this job stops without committing"
            )
            raise WriteConflictError(self.lost)

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self.check()
                call(put_bytes(self.storage, LEASE_KEY, self._doc()), self.ttl_s)
            except WriteConflictError:
                return
            except Exception as exc:  # a missed beat is retried at the next one
                log.warning("%s: lease heartbeat failed: %s", self.storage.url, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours (no wait for the next)."""
        self.stop()
        if self.lost is None:
            with contextlib.suppress(Exception):
                doc = call(get_json(self.storage, LEASE_KEY), self.ttl_s)
                if doc is not None and doc.get("owner") == self.owner:
                    call(self.storage.delete(LEASE_KEY), self.ttl_s)
            remove_empty_work_dir(self.storage)


# -- rank heartbeats (multi-node jobs) -------------------------------------------------

#: A rank writing its shards rewrites its heartbeat this often.
RANK_BEAT_S = 5.0
#: A rank whose heartbeat has not changed for this long (as seen by the waiting rank's
#: own clock, so clocks of different hosts don't matter) is gone.
RANK_TTL_S = 30.0


def rank_key(gen: str, rank: int) -> str:
    return f"{WORK_PREFIX}/{gen}/rank-{rank}.json"


class RankBeat:
    """Rank ``rank``'s heartbeat ``_optimize/<gen>/rank-<r>.json`` while it writes shards.

    The finisher watches the heartbeats of the ranks whose shards are missing, so a rank
    killed outright (it posts no failure marker) stops the job within :data:`RANK_TTL_S`
    (at once when it ran on the finisher's host: its pid is gone) instead of after the
    progress bound.
    """

    def __init__(self, storage: Storage, gen: str, rank: int, every_s: float = RANK_BEAT_S):
        self.storage, self.key, self.rank, self.every_s = (
            storage,
            rank_key(gen, rank),
            rank,
            every_s,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._n = 0

    def _doc(self) -> bytes:
        self._n += 1
        doc = {"rank": self.rank, "pid": os.getpid(), **this_host(),
               "heartbeat": time.time(), "beat": self._n}  # fmt: skip
        return json.dumps(doc).encode()

    def start(self) -> None:
        call(put_bytes(self.storage, self.key, self._doc()), RANK_TTL_S)
        self._thread = threading.Thread(target=self._beat, name="asynccache-rank", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                call(put_bytes(self.storage, self.key, self._doc()), RANK_TTL_S)
            except Exception as exc:  # a missed beat is retried at the next one
                log.warning("%s: rank heartbeat failed: %s", self.storage.url, exc)

    def stop(self) -> None:
        """Stop beating and remove the heartbeat (the rank's shards are all written)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=RANK_TTL_S)
        with contextlib.suppress(Exception):
            call(self.storage.delete(self.key), RANK_TTL_S)


class PeerWatch:
    """Tells when a peer whose heartbeat object is ``key`` is gone.

    Gone: its document names a pid on this host that no longer exists, or it did not
    change (or never appeared) for ``ttl_s`` seconds of this process's monotonic clock.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[Any, float]] = {}

    def gone(self, key: str, doc: Mapping[str, Any] | None) -> str | None:
        """None while the peer looks alive, else why it is considered gone."""
        now = time.monotonic()
        beat = None if doc is None else (doc.get("heartbeat"), doc.get("beat"))
        last, since = self._seen.get(key, (None, now))
        if key not in self._seen or beat != last:
            self._seen[key] = (beat, now)
            since = now
        pid = doc.get("pid") if doc else None
        if doc is not None and same_host(doc) and isinstance(pid, int) and not pid_alive(pid):
            return f"its process (pid {pid} on this host) is gone"
        if now - since > self.ttl_s:
            what = "no heartbeat" if doc is None else "no new heartbeat"
            return f"{what} for {now - since:.0f}s"
        return None


def remove_empty_work_dir(storage: Storage) -> None:
    """A local output keeps no empty ``_optimize/`` directories (object stores have none)."""
    path = storage.local_path(WORK_PREFIX + "/x")
    if path is None:
        return
    work = os.path.dirname(path)
    with contextlib.suppress(OSError):
        for name in os.listdir(work):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(work, name))  # only empty directories go
        os.rmdir(work)


def new_gen() -> str:
    return secrets.token_hex(4)


def start(
    storage: Storage,
    lease: Lease,
    *,
    url: str,
    num_inputs: int,
    num_shards: int,
    fp: str,
    chunk_bytes: int,
    compression: str | None,
    mode: str,
    on_error: str,
    storage_options: Mapping[str, Any] | None,
    settings: Settings,
    aws_env: Mapping[str, str],
    tokens: str | None = None,
) -> tuple[Job, bool]:
    """With the lease held: resume the unfinished job of these arguments, or plan a new one.

    Returns ``(job, committed)``; ``committed`` is True when this very job already wrote
    its ``index.json`` (a rerun after a crash during cleanup).

    Raises:
        DatasetExistsError: ``mode="create"`` and a dataset is already there.
        ConfigError: ``mode="append"`` to a dataset of another kind (tokens or items, or
            another token dtype).
    """
    from ..errors import ConfigError, DatasetExistsError

    current = call(read_index(storage))
    if mode == "append" and current is not None and current.config.get("token_dtype") != tokens:
        raise ConfigError(
            f"{url}: can't append with tokens={tokens!r} to a dataset written with "
            f"tokens={current.config.get('token_dtype')!r}"
        )
    plan = call(get_json(storage, JOB_KEY))
    base = current.checksum if (mode == "append" and current is not None) else None
    args = dict(
        url=url,
        owner=lease.owner,
        num_inputs=num_inputs,
        fingerprint=fp,
        chunk_bytes=chunk_bytes,
        compression=compression,
        mode=mode,
        on_error=on_error,
        storage_options=storage_options,
        settings=settings,
        aws_env=aws_env,
        tokens=tokens,
    )
    if plan is not None and plan.get("fingerprint") == fp and plan.get("mode") == mode:
        gen = str(plan["gen"])
        if current is not None and current.config.get("generation") == gen:
            job = Job(gen=gen, num_shards=int(plan["num_shards"]), **args)  # type: ignore[arg-type]
            return job, True
        if plan.get("base_checksum") == base:
            listing = call(storage.list(f"{WORK_PREFIX}/{gen}/"))
            stale = [o.key for o in listing if "/failed-" in o.key]  # from the stopped run
            call(delete_many(storage, stale))
            done = frozenset(
                int(o.key.rsplit("shard-", 1)[1].split(".", 1)[0])
                for o in listing
                if o.key.endswith(".index.json")
            )
            log.info("%s: resuming job %s: %d shards already done", url, gen, len(done))
            job = Job(
                gen=gen,
                num_shards=int(plan["num_shards"]),
                base_checksum=base,
                done=done,
                **args,  # type: ignore[arg-type]
            )
            return job, False
    if plan is not None:  # an unfinished job with other arguments: its files go
        log.warning("%s: discarding the unfinished job %s (other arguments)", url, plan.get("gen"))
        discard(storage, str(plan.get("gen")))
    if mode == "create" and current is not None:
        raise DatasetExistsError(
            f"{url}: a dataset is already there ({current.total_items} items); pass "
            "mode='overwrite' to replace it or mode='append' to add to it"
        )
    job = Job(gen=new_gen(), num_shards=num_shards, base_checksum=base, **args)  # type: ignore[arg-type]
    call(put_bytes(storage, JOB_KEY, json.dumps(job.plan_doc()).encode()))
    return job, False


def discard(storage: Storage, gen: str) -> None:
    """Delete every file of the uncommitted job ``gen`` (chunks and shard indexes)."""
    if not gen or "/" in gen:
        return
    keys = [o.key for o in call(storage.list(chunk_prefix(gen)))]
    keys += [o.key for o in call(storage.list(f"{WORK_PREFIX}/{gen}/"))]
    call(delete_many(storage, keys))


def check_current(storage: Storage, job: Job) -> Index | None:
    """The index ``append`` extends; raises WriteConflictError when it changed under us."""
    current = call(read_index(storage))
    if job.mode == "append":
        now = current.checksum if current is not None else None
        if now != job.base_checksum:
            raise WriteConflictError(
                f"{job.url}: index.json changed while this append ran; nothing was committed"
            )
        return current
    return None
