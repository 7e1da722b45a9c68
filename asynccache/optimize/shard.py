"""Writing one shard: ``fn`` over a slice of the inputs -> chunks in the output + a shard index.

Chunks close at ``chunk_bytes`` and are uploaded at once, on the process's I/O thread,
while ``fn`` keeps producing the next one: upload overlaps with writing. At most
``staged_chunks`` closed chunks wait on local disk per process (the staging bound); when
they are all in flight, writing waits for the oldest upload. A local output directory
needs no staging: chunks are written in place (temp file, rename; fsynced together, with
their directory, before the shard index names them).

The shard index ``_optimize/<gen>/shard-<k>.index.json`` is written after every chunk
it names is stored; it numbers the shard's items ``0 .. n-1`` in input order, and the
finisher shifts them (so ``index.json`` has one key run per chunk whatever the order).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import inspect
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._version import __version__
from ..config import Settings
from ..errors import CacheError, ConfigError, InputFailedError, StorageError
from ..format import ChunkEntry, Index, build, encode, encoded_size
from ..format.index import format_checksum, new_hasher
from ..storage import Storage
from .job import (
    IO_BOUND_S,
    Job,
    call,
    chunk_name,
    put_bytes,
    shard_key,
    sync_files,
    upload_retried,
    write_file,
)

#: Closed chunks in hand per process, at most: written in the background (in memory
#: until written, memory <= (this + 1) x chunk_bytes) and uploaded (staging disk <= this x
#: chunk_bytes).
STAGED_CHUNKS = 3
#: Threads per process writing (and uploading) closed chunks while fn runs.
_STORE_THREADS = 2
#: Errors kept verbatim in a shard's report (the count is exact).
MAX_REPORTED = 20

Progress = Callable[[int, int, int], None]  # (inputs, items, bytes) done since last call


@dataclasses.dataclass(frozen=True)
class ShardResult:
    """What :func:`write_shard` did: counts, and the inputs skipped with ``on_error="skip"``."""

    shard: int
    inputs: int
    items: int
    bytes: int
    chunks: int
    skipped: int
    errors: tuple[str, ...] = ()


class _Stager:
    """Stores closed chunks in the background, so ``fn`` keeps running meanwhile.

    A local output gets each chunk in place (temp file, rename; the kernel starts its
    writeback at once and :meth:`drain` fsyncs the shard's chunks before the shard index
    is written, unless ``ASYNCCACHE_DURABLE=0``); a remote one gets it staged in
    ``staging_dir`` and uploaded from there (with retries), the staged file deleted after.
    Either way the items' buffers go to the kernel as they are (``writev``), no copy.
    At most ``limit`` closed chunks are in hand at once (held in memory until written, on
    disk until uploaded); ``put`` waits for the oldest beyond that.
    """

    def __init__(
        self, storage: Storage, staging_dir: str | None, limit: int, settings: Settings
    ) -> None:
        self.storage, self.settings = storage, settings
        self.local_root = storage.local_path("x") is not None
        self.limit = max(1, limit)
        self._pending: collections.deque[concurrent.futures.Future[tuple[int, str]]] = (
            collections.deque()
        )
        self._threads = concurrent.futures.ThreadPoolExecutor(
            _STORE_THREADS, thread_name_prefix="asynccache-stage"
        )
        self._dir: str | None = None
        self._made: set[str] = set()
        self._lock = threading.Lock()
        self._unsynced: list[str] = []  # local chunks written, not fsynced yet
        if not self.local_root:
            self._dir = tempfile.mkdtemp(prefix="asynccache-staging-", dir=staging_dir)

    def put(
        self, name: str, items: list[list[memoryview | bytes]]
    ) -> concurrent.futures.Future[tuple[int, str]]:
        """Store a chunk of ``items``; the future gives its ``(size, checksum)``."""
        while len(self._pending) >= self.limit:  # the staging bound
            self._pending.popleft().result(IO_BOUND_S)
        fut = self._threads.submit(self._store, name, items)
        self._pending.append(fut)
        return fut

    def _store(self, name: str, items: list[list[memoryview | bytes]]) -> tuple[int, str]:
        hasher = new_hasher()
        if self.local_root:
            # In place, straight from the items' buffers. Not fsynced here: the kernel
            # starts writing it back now, and :meth:`drain` fsyncs the shard's chunks
            # (and their directory) before the shard index names them.
            path = self.storage.local_path(name)
            assert path is not None
            directory = os.path.dirname(path)
            if directory not in self._made:
                os.makedirs(directory, exist_ok=True)
                self._made.add(directory)
            durable = self.settings.durable
            size = write_file(path, build(items), hasher=hasher, writeback=durable)
            if durable:
                with self._lock:
                    self._unsynced.append(path)
            return size, format_checksum(hasher)
        assert self._dir is not None
        path = os.path.join(self._dir, name)
        size = write_file(path, build(items), hasher=hasher)
        try:
            call(upload_retried(self.storage, path, name, self.settings), IO_BOUND_S)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return size, format_checksum(hasher)

    def drain(self) -> None:
        """Wait for every chunk handed over; a local output's are then on disk."""
        while self._pending:
            self._pending.popleft().result(IO_BOUND_S)
        with self._lock:
            paths, self._unsynced = self._unsynced, []
        if paths:
            try:
                sync_files(paths)
            except OSError as exc:
                raise CacheError(f"cannot flush {paths[0]} to disk: {exc.strerror}") from exc

    def close(self) -> None:
        for fut in self._pending:
            fut.cancel()
        self._threads.shutdown(wait=True, cancel_futures=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


# Failures of the output itself, never blamed on an input.
_StorageError = (StorageError, CacheError)


def _outputs(fn: Callable[[Any], Any], x: Any) -> Iterable[Any]:
    out = fn(x)
    if out is None:
        return ()
    if inspect.isgenerator(out):
        return out
    return (out,)


def _name(i: int, x: Any) -> str:
    text = repr(x)
    return f"input #{i} ({text if len(text) <= 200 else text[:200] + '...'})"


def write_shard(
    job: Job,
    fn: Callable[[Any], Any],
    inputs: Sequence[Any],
    shard: int,
    *,
    staging_dir: str | None = None,
    staged_chunks: int = STAGED_CHUNKS,
    progress: Progress | None = None,
) -> ShardResult:
    """Convert ``inputs`` (``inputs[slice(*job.bounds(shard))]`` of the job) as shard ``shard``.

    Runs anywhere that can reach the output: a pool worker, another node, a Ray/Dask/Spark
    task. Writing the same shard twice is harmless (same chunk names; the last one wins).

    Args:
        job: from :func:`asynccache.optimize.start_job` (picklable).
        fn: ``fn(input)`` returns one item, yields several, or returns None (nothing).
        inputs: this shard's inputs.
        shard: the shard number, ``0 <= shard < job.num_shards``.
        staging_dir: where closed chunks wait for upload (default: the temp directory).
        staged_chunks: at most this many closed chunks wait on disk.
        progress: called with ``(inputs, items, bytes)`` done since its last call.

    Raises:
        InputFailedError: ``fn`` raised (or returned something unstorable) on an input, and
            ``job.on_error`` is ``"raise"``; the message names the input.
        StorageError: a chunk or the shard index could not be stored.
    """
    start, stop = job.bounds(shard)
    if len(inputs) != stop - start:
        raise ConfigError(
            f"shard {shard} covers inputs[{start}:{stop}] ({stop - start} inputs), "
            f"got {len(inputs)}"
        )
    storage = job.open_storage()
    stager = _Stager(storage, staging_dir, staged_chunks, job.settings)
    entries: list[tuple[str, int, int, concurrent.futures.Future[tuple[int, str]]]] = []
    buf: list[list[memoryview | bytes]] = []
    buf_bytes = 0
    items = 0
    skipped = 0
    errors: list[str] = []
    skip = job.on_error == "skip"
    report = [0, 0, 0]
    last_report = time.monotonic()

    def flush() -> None:
        nonlocal buf, buf_bytes
        if not buf:
            return
        name = chunk_name(job.gen, shard, len(entries))
        first = items - len(buf)
        entries.append((name, len(buf), first, stager.put(name, buf)))
        report[2] += buf_bytes
        buf, buf_bytes = [], 0

    def add(pieces: list[memoryview | bytes]) -> None:
        nonlocal buf_bytes, items
        size = encoded_size(pieces) + 8
        if buf and buf_bytes + size > job.chunk_bytes:
            flush()
        buf.append(pieces)
        buf_bytes += size
        items += 1

    try:
        for j, x in enumerate(inputs):
            failed: Exception | None = None
            encoded: list[list[memoryview | bytes]] = []
            try:
                it = iter(_outputs(fn, x))
                while True:
                    try:
                        o = next(it)
                    except StopIteration:
                        break
                    pieces = encode(o, compression=job.compression)
                    if skip:  # all of an input's items, or none of them
                        encoded.append(pieces)
                    else:
                        add(pieces)  # storage errors from here are not the input's
                        report[1] += 1
            except _StorageError:
                raise
            except Exception as exc:
                failed = exc
            if failed is not None:
                what = f"{_name(start + j, x)}: {type(failed).__name__}: {failed}"
                if not skip:
                    raise InputFailedError(f"fn failed on {what}") from failed
                skipped += 1
                if len(errors) < MAX_REPORTED:
                    errors.append(what)
            else:
                for pieces in encoded:
                    add(pieces)
                report[1] += len(encoded)
            report[0] += 1
            now = time.monotonic()
            if progress is not None and now - last_report > 0.2:
                progress(*report)
                report[:] = [0, 0, 0]
                last_report = now
        flush()
        stager.drain()
        chunks = []
        for name, count, first, fut in entries:
            size, checksum = fut.result()
            chunks.append(ChunkEntry(name, count, size, checksum, ((first, count),)))
        total_bytes = sum(c.bytes for c in chunks)
        config = {
            "chunk_bytes": job.chunk_bytes,
            "compression": job.compression,
            "writer": f"asynccache {__version__}",
            "inputs": len(inputs),
            "skipped": skipped,
            "errors": errors,
        }
        idx = Index(tuple(chunks), config, shard, job.gen)
        call(put_bytes(storage, shard_key(job.gen, shard), idx.to_json().encode(), job.settings))
    finally:
        stager.close()
        with contextlib.suppress(Exception):
            call(storage.close(), 30.0)
    if progress is not None:
        progress(*report)
    return ShardResult(shard, len(inputs), items, total_bytes, len(entries), skipped, tuple(errors))
