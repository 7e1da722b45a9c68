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
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from .._version import __version__
from ..config import Settings
from ..errors import CacheError, ConfigError, InputFailedError, StorageError, StorageTimeoutError
from ..format import ChunkEntry, Index, build, encode, encoded_size
from ..format.index import format_checksum, new_hasher
from ..format.tokens import encode_tokens, flags_for, token_dtype
from ..storage import Storage
from . import watch
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
from .staging import StagingDir

#: Closed chunks in hand per process, at most: written in the background (in memory
#: until written, memory <= (this + 1) x chunk_bytes) and uploaded (staging disk <= this x
#: chunk_bytes).
STAGED_CHUNKS = 3
#: Threads per process writing (and uploading) closed chunks while fn runs.
_STORE_THREADS = 2
#: Errors kept verbatim in a shard's report (the count is exact).
MAX_REPORTED = 20

Progress = Callable[[int, int, int], None]  # (inputs, items, bytes) done since last call

T = TypeVar("T")


def wait_for(fut: concurrent.futures.Future[T], what: str, timeout: float = IO_BOUND_S) -> T:
    """``fut.result`` bounded by ``timeout``; past it, StorageTimeoutError naming ``what``.

    (An error ``fut`` itself ended with is raised as it is, even a TimeoutError.)
    """
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError as exc:
        if fut.done():
            raise
        raise StorageTimeoutError(f"{what} was not stored within {timeout:.0f}s") from exc


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
    writeback at once and :meth:`sync` fsyncs the shard's chunks before the shard index
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
        self._pending: collections.deque[
            tuple[str, concurrent.futures.Future[tuple[int, str, str | None]]]
        ] = collections.deque()
        self._threads = concurrent.futures.ThreadPoolExecutor(
            _STORE_THREADS, thread_name_prefix="asynccache-stage"
        )
        self._staging: StagingDir | None = None
        self._dir: str | None = None
        self._made: set[str] = set()
        self._finisher = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="asynccache-finish"
        )
        if not self.local_root:
            self._staging = StagingDir(staging_dir)  # (removes orphans of killed workers)
            self._dir = self._staging.path

    def put(
        self, name: str, items: list[list[memoryview | bytes]], flags: int = 0
    ) -> concurrent.futures.Future[tuple[int, str, str | None]]:
        """Store a chunk of ``items`` (chunk header ``flags``); the future gives its
        ``(size, checksum, header checksum)``."""
        if len(self._pending) >= self.limit:  # the staging bound: wait for the oldest
            with watch.clock().paused():  # (storage's time, not fn's)
                while len(self._pending) >= self.limit:
                    oldest, fut = self._pending.popleft()
                    wait_for(fut, self.storage.object_url(oldest))
        fut = self._threads.submit(self._store, name, items, flags)
        self._pending.append((name, fut))
        return fut

    def _store(
        self, name: str, items: list[list[memoryview | bytes]], flags: int = 0
    ) -> tuple[int, str, str | None]:
        hasher = new_hasher()
        chunk = build(items, flags)
        if self.local_root:
            # In place, straight from the items' buffers. Not fsynced here: the kernel
            # starts writing it back now, and :meth:`sync` fsyncs the shard's chunks
            # (and their directory) before the shard index names them.
            path = self.storage.local_path(name)
            assert path is not None
            directory = os.path.dirname(path)
            if directory not in self._made:
                os.makedirs(directory, exist_ok=True)
                self._made.add(directory)
            durable = self.settings.durable
            size = write_file(path, chunk, hasher=hasher, writeback=durable)
            return size, format_checksum(hasher), chunk.head
        assert self._dir is not None
        path = os.path.join(self._dir, name)
        size = write_file(path, chunk, hasher=hasher)
        try:
            call(
                upload_retried(self.storage, path, name, self.settings),
                IO_BOUND_S,
                what=self.storage.object_url(name),
            )
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return size, format_checksum(hasher), chunk.head

    def finish(self, fn: Callable[[], ShardResult]) -> concurrent.futures.Future[ShardResult]:
        """Run ``fn`` (a shard's finish: wait for its chunks, write its index) in the background.

        One thread, in order, beside the chunk threads: the next shard's ``fn`` and
        uploads go on while a shard's last chunks are stored and its index written.
        """
        return self._finisher.submit(fn)

    def sync(self, names: Sequence[str]) -> None:
        """fsync the local chunks ``names`` (stored already) and their directory."""
        if not (self.local_root and self.settings.durable and names):
            return
        paths = [p for p in map(self.storage.local_path, names) if p is not None]
        try:
            sync_files(paths)
        except OSError as exc:
            raise CacheError(f"cannot flush {paths[0]} to disk: {exc.strerror}") from exc

    def close(self) -> None:
        for _, fut in self._pending:
            fut.cancel()
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._finisher.shutdown(wait=True, cancel_futures=True)
        if self._staging is not None:
            self._staging.close()


# Failures of the output itself, never blamed on an input.
_StorageError = (StorageError, CacheError)


def _outputs(fn: Callable[[Any], Any], x: Any) -> Iterable[Any]:
    out = fn(x)
    if out is None:
        return ()
    if inspect.isgenerator(out):
        return out
    return (out,)


def _shard_what(job: Job, k: int) -> str:
    return f"{job.url}: shard {k} (its chunks and shard index)"


def input_name(i: int, x: Any) -> str:
    """``input #i (repr)``, the repr cut at 200 characters: how errors name an input."""
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
    return write_shards(
        job, fn, [(shard, inputs)], staging_dir=staging_dir, staged_chunks=staged_chunks,
        progress=progress,
    )[0]  # fmt: skip


def write_shards(
    job: Job,
    fn: Callable[[Any], Any],
    shards: Sequence[tuple[int, Sequence[Any]]],
    *,
    staging_dir: str | None = None,
    staged_chunks: int = STAGED_CHUNKS,
    progress: Progress | None = None,
) -> list[ShardResult]:
    """:func:`write_shard` for several ``(shard, inputs)`` in turn, pipelined.

    A shard is finished (its last chunks stored, fsynced, its shard index written) while
    ``fn`` already runs on the next shard's inputs, so writing never stops at a shard's
    end to wait for its last uploads. Each shard index is still written only after
    every chunk it names is stored, and shard ``k`` is finished before shard ``k + 2``
    starts.
    """
    for k, inputs in shards:
        start, stop = job.bounds(k)
        if len(inputs) != stop - start:
            raise ConfigError(
                f"shard {k} covers inputs[{start}:{stop}] ({stop - start} inputs), "
                f"got {len(inputs)}"
            )
    storage = job.open_storage()
    stager = _Stager(storage, staging_dir, staged_chunks, job.settings)
    report = [0, 0, 0]
    finishing: list[concurrent.futures.Future[ShardResult]] = []
    try:
        for k, inputs in shards:
            if len(finishing) >= 2:  # at most one shard finishes behind: a killed
                wait_for(finishing[-2], _shard_what(job, shards[len(finishing) - 2][0]))
            shard = _Shard(job, fn, k, inputs, stager, report, progress)
            shard.produce(finishing)
            finishing.append(stager.finish(shard.finish))
        results = [
            wait_for(f, _shard_what(job, k)) for f, (k, _) in zip(finishing, shards, strict=True)
        ]
    finally:
        stager.close()
        with contextlib.suppress(Exception):
            call(storage.close(), 30.0)
    if progress is not None:
        progress(*report)
    return results


class _Shard:
    """One shard being written: :meth:`produce` its chunks, then :meth:`finish` it."""

    def __init__(
        self,
        job: Job,
        fn: Callable[[Any], Any],
        shard: int,
        inputs: Sequence[Any],
        stager: _Stager,
        report: list[int],
        progress: Progress | None,
    ) -> None:
        self.job, self.fn, self.shard, self.inputs = job, fn, shard, inputs
        self.stager, self.report, self.progress = stager, report, progress
        self.entries: list[
            tuple[str, int, int, int | None, concurrent.futures.Future[tuple[int, str, str | None]]]
        ] = []
        self.buf: list[list[memoryview | bytes]] = []
        self.buf_bytes = 0
        # A token dataset: each item is a document stored as raw tokens (docs/tokens.md).
        self.dtype = None if job.tokens is None else token_dtype(job.tokens)
        self.flags = 0 if self.dtype is None else flags_for(self.dtype)
        self.buf_tokens = 0
        self.items = 0
        self.skipped = 0
        self.errors: list[str] = []
        self.result: ShardResult | None = None

    def _flush(self) -> None:
        if not self.buf:
            return
        name = chunk_name(self.job.gen, self.shard, len(self.entries))
        first = self.items - len(self.buf)
        tokens = None if self.dtype is None else self.buf_tokens // self.dtype.itemsize
        fut = self.stager.put(name, self.buf, self.flags)
        self.entries.append((name, len(self.buf), first, tokens, fut))
        self.report[2] += self.buf_bytes
        self.buf, self.buf_bytes, self.buf_tokens = [], 0, 0

    def _add(self, pieces: list[memoryview | bytes]) -> None:
        size = encoded_size(pieces) + 8
        if self.buf and self.buf_bytes + size > self.job.chunk_bytes:
            self._flush()
        self.buf.append(pieces)
        self.buf_bytes += size
        self.buf_tokens += size - 8
        self.items += 1

    def produce(self, finishing: list[concurrent.futures.Future[ShardResult]]) -> None:
        """Run ``fn`` over the inputs and hand every chunk to the stager.

        ``finishing``: the earlier shards being finished in the background; the first
        failure among them is raised here, between two inputs.
        """
        job, report, fn = self.job, self.report, self.fn
        start = job.bounds(self.shard)[0]
        skip = job.on_error == "skip"
        compression = job.compression
        clock = watch.clock()
        last_report = time.monotonic()
        for j, x in enumerate(self.inputs):
            failed: Exception | None = None
            encoded: list[list[memoryview | bytes]] = []
            clock.begin(start + j)
            try:
                for o in _outputs(fn, x):
                    if self.dtype is not None:
                        pieces = encode_tokens(o, self.dtype)
                    else:
                        pieces = encode(o, compression=compression)
                    if skip:  # all of an input's items, or none of them
                        encoded.append(pieces)
                    else:
                        self._add(pieces)  # storage errors from here are not the input's
                        report[1] += 1
            except _StorageError:
                raise
            except Exception as exc:
                failed = exc
            finally:
                clock.end()
            if failed is not None:
                what = f"{input_name(start + j, x)}: {type(failed).__name__}: {failed}"
                if not skip:
                    raise InputFailedError(f"fn failed on {what}") from failed
                self.skipped += 1
                if len(self.errors) < MAX_REPORTED:
                    self.errors.append(what)
            else:
                for pieces in encoded:
                    self._add(pieces)
                report[1] += len(encoded)
            report[0] += 1
            for f in finishing:
                if f.done() and f.exception() is not None:
                    f.result()
            if self.progress is not None:
                now = time.monotonic()
                if now - last_report > 0.2:
                    self.progress(*report)
                    report[:] = [0, 0, 0]
                    last_report = now
        self._flush()

    def finish(self) -> ShardResult:
        """Wait for the shard's chunks (fsync them, locally), then write its shard index."""
        if self.result is not None:
            return self.result
        job = self.job
        chunks = []
        for name, count, first, tokens, fut in self.entries:
            size, checksum, head = wait_for(fut, self.stager.storage.object_url(name))
            chunks.append(ChunkEntry(name, count, size, checksum, ((first, count),), tokens, head))
        self.stager.sync([name for name, *_ in self.entries])
        config = {
            "chunk_bytes": job.chunk_bytes,
            "compression": job.compression,
            "writer": f"asynccache {__version__}",
            "inputs": len(self.inputs),
            "skipped": self.skipped,
            "errors": self.errors,
        }
        if job.tokens is not None:
            config["token_dtype"] = job.tokens
        idx = Index(tuple(chunks), config, self.shard, job.gen)
        key = shard_key(job.gen, self.shard)
        call(
            put_bytes(self.stager.storage, key, idx.to_json().encode(), job.settings),
            what=self.stager.storage.object_url(key),
        )
        self.result = ShardResult(
            self.shard, len(self.inputs), self.items, sum(c.bytes for c in chunks),
            len(chunks), self.skipped, tuple(self.errors),
        )  # fmt: skip
        return self.result
