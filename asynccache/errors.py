"""The exception tree. Every failure a user can cause raises one of these.

Each class also inherits the builtin a caller would already catch, so
``except FileNotFoundError`` keeps working around asynccache calls::

    AsyncCacheError
    ├── ConfigError (ValueError)           bad setting, env value, URL or argument
    │   └── DatasetExistsError (FileExistsError)  optimize(mode="create") over a dataset
    ├── StorageError (OSError)             anything the storage backend reports
    │   ├── ObjectNotFoundError (FileNotFoundError)   missing bucket, key, file
    │   ├── AuthError (PermissionError)               rejected or missing credentials
    │   ├── TransientError                            5xx, 429, resets, short reads
    │   │   ├── StorageTimeoutError (TimeoutError)    no answer within the timeout
    │   │   └── ThrottledError                        429, 503, SlowDown: the service asks to wait
    │   └── RetriesExhaustedError                     transient errors outlived the retry budget
    │       └── ThrottleTimeoutError (TimeoutError)   throttled past ASYNCCACHE_THROTTLE_PATIENCE_S
    ├── DataError (ValueError)             a file's bytes are not what they must be
    │   ├── BadMagicError                  not an asynccache chunk
    │   ├── UnsupportedVersionError        written by a format version we can't read
    │   ├── TruncatedChunkError            shorter than its header or index says
    │   ├── ChecksumMismatchError          bytes differ from the index's checksum
    │   │   └── DatasetRewrittenError      the object changed (size, ETag) since the index was read
    │   ├── CorruptFooterError             a Parquet file's footer can't be read (names the file)
    │   ├── SchemaMismatchError            a source file's schema differs from the first file's
    │   ├── BadIndexError                  index.json malformed or inconsistent
    │   │   ├── UnsafePathError            index names a path outside its directory
    │   │   └── CorruptIndexError          index.json bytes differ from its own checksum
    │   └── SerializationError (TypeError) an item holds a leaf we can't store
    ├── CacheError (OSError)               local cache directory problems
    │   ├── DiskFullError                  the cache's filesystem is full, even after evicting
    │   └── WriteConflictError             another job is writing the same output directory
    ├── ResumeStateError (ValueError)      a state_dict that doesn't fit this loader
    ├── InputFailedError (RuntimeError)    optimize's fn raised on an input (named)
    │   └── InputTimeoutError (TimeoutError)  fn ran past optimize's input_timeout_s (named)
    ├── WorkerDiedError (RuntimeError)     an optimize worker process died; a rerun resumes
    ├── WorkerStartError (TimeoutError)    a DataLoader's workers did not start in time
    └── BridgeError (RuntimeError)         misuse of the I/O thread (a call from inside it), or a
                                           dataset closed while another thread's read waited

Lower-layer exceptions are translated at the layer boundary and always chained
with ``raise ... from exc``, so the original cause stays in the traceback.
"""

from __future__ import annotations

__all__ = [
    "AsyncCacheError",
    "AuthError",
    "BadIndexError",
    "BadMagicError",
    "BridgeError",
    "CacheError",
    "ChecksumMismatchError",
    "ConfigError",
    "CorruptFooterError",
    "CorruptIndexError",
    "DataError",
    "DatasetExistsError",
    "DatasetRewrittenError",
    "DiskFullError",
    "InputFailedError",
    "InputTimeoutError",
    "ObjectNotFoundError",
    "ResumeStateError",
    "RetriesExhaustedError",
    "SchemaMismatchError",
    "SerializationError",
    "StorageError",
    "StorageTimeoutError",
    "ThrottleTimeoutError",
    "ThrottledError",
    "TransientError",
    "TruncatedChunkError",
    "UnsafePathError",
    "UnsupportedVersionError",
    "WorkerDiedError",
    "WorkerStartError",
    "WriteConflictError",
]


class AsyncCacheError(Exception):
    """Root of every error asynccache raises on purpose."""


class ConfigError(AsyncCacheError, ValueError):
    """A setting, environment variable, URL or argument is invalid."""


class StorageError(AsyncCacheError, OSError):
    """The storage backend failed; the message names the URL."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url

    def __str__(self) -> str:  # OSError's __str__ would mangle a single-arg message
        return str(self.args[0]) if self.args else ""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The bucket, object or file does not exist."""


class AuthError(StorageError, PermissionError):
    """Credentials were rejected or are missing. Never contains a secret."""


class TransientError(StorageError):
    """A failure that may succeed when retried (5xx, 429, reset, short read)."""

    def __init__(
        self, message: str, *, url: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, url=url)
        self.retry_after = retry_after


class StorageTimeoutError(TransientError, TimeoutError):
    """The storage did not answer within the configured timeout."""


class ThrottledError(TransientError):
    """The service asked the client to slow down (429, 503, ``SlowDown``, ``ServerBusy``).

    Retried with a patience measured in seconds of backoff
    (``ASYNCCACHE_THROTTLE_PATIENCE_S``), not against the count of ``ASYNCCACHE_RETRIES``.
    """


class RetriesExhaustedError(StorageError):
    """Transient errors continued past the retry budget."""

    def __init__(self, message: str, *, url: str | None = None, attempts: int = 0) -> None:
        super().__init__(message, url=url)
        self.attempts = attempts


class ThrottleTimeoutError(RetriesExhaustedError, TimeoutError):
    """The service kept throttling one request past ``ASYNCCACHE_THROTTLE_PATIENCE_S``
    seconds of backoff (the message names the URL and the patience)."""


class DataError(AsyncCacheError, ValueError):
    """A file's bytes are not a valid asynccache file; the message names the file."""


class BadMagicError(DataError):
    """The file does not start with the chunk magic bytes."""


class UnsupportedVersionError(DataError):
    """The file was written by a format version this release cannot read."""


class TruncatedChunkError(DataError):
    """The file is shorter than its header or the index says."""


class ChecksumMismatchError(DataError):
    """The file's checksum differs from the one recorded in the index."""


class DatasetRewrittenError(ChecksumMismatchError):
    """A chunk's object changed since this reader opened ``index.json``: its size differs
    from the index's, its ETag changed between two downloads, it is gone, or (where the
    ETag is the MD5 of the bytes) its bytes arrived intact and differ from the index. The
    dataset was rewritten at its URL: not retried; open it again to read the new version.
    The message names the chunk."""


class CorruptFooterError(DataError):
    """A Parquet file's footer (its metadata) can't be read: its length field does not fit
    the file, pyarrow refuses it, or a range it gives lies outside the file. The message
    names the file."""


class SchemaMismatchError(DataError):
    """A file of a multi-file source (Parquet) has another schema than the first file, for
    the columns read. The message names both files and the first difference."""


class BadIndexError(DataError):
    """``index.json`` is malformed or inconsistent."""


class UnsafePathError(BadIndexError):
    """The index names a path outside the dataset directory."""


class CorruptIndexError(BadIndexError):
    """``index.json`` does not match the checksum it carries: damaged in transit or on disk.

    Readers fetch a remote index again (a transient fault) and raise this only once the
    retry budget is spent.
    """


class SerializationError(DataError, TypeError):
    """An item contains a leaf type that cannot be stored."""


class CacheError(AsyncCacheError, OSError):
    """The local cache directory cannot be used (full disk, permissions)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DiskFullError(CacheError):
    """The filesystem holding the cache is full, even after evicting what could go."""


class WriteConflictError(CacheError):
    """Another job is writing into the same output directory (its lock is held)."""


class DatasetExistsError(ConfigError, FileExistsError):
    """``optimize(mode="create")`` found a dataset (``index.json``) at the output already."""


class InputFailedError(AsyncCacheError, RuntimeError):
    """``optimize``'s ``fn`` raised on an input; the message names the input."""


class InputTimeoutError(InputFailedError, TimeoutError):
    """``optimize``'s ``fn`` ran longer than ``input_timeout_s`` on one input (named, with
    its shard); its worker was stopped, finished shards are kept and a rerun resumes."""


class WorkerDiedError(AsyncCacheError, RuntimeError):
    """An ``optimize`` worker process died (killed, out of memory); a rerun resumes."""


class WorkerStartError(AsyncCacheError, TimeoutError):
    """A DataLoader's worker processes did not start within the bound (the message names
    the loader's start method, its worker count and the bound)."""


class ResumeStateError(AsyncCacheError, ValueError):
    """A ``state_dict`` does not belong to this dataset, seed or shuffle setting."""


class BridgeError(AsyncCacheError, RuntimeError):
    """The I/O thread was misused (a blocking call from inside its own loop), or a dataset
    was closed while another thread's read waited for one of its chunks."""
