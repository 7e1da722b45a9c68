"""asynccache: train PyTorch models on datasets that live in object storage."""

from ._version import __version__
from .config import Settings
from .download.stats import DownloadStats
from .errors import (
    AsyncCacheError,
    AuthError,
    BadIndexError,
    BadMagicError,
    BridgeError,
    CacheError,
    ChecksumMismatchError,
    ConfigError,
    CorruptIndexError,
    DataError,
    DatasetExistsError,
    DiskFullError,
    InputFailedError,
    ObjectNotFoundError,
    ResumeStateError,
    RetriesExhaustedError,
    SerializationError,
    StorageError,
    StorageTimeoutError,
    TransientError,
    TruncatedChunkError,
    UnsafePathError,
    UnsupportedVersionError,
    WorkerDiedError,
    WriteConflictError,
)
from .optimize import OptimizeResult, optimize
from .prefetch import prefetch
from .torch.cache import Cache, CacheNotFilledError
from .torch.dataloader import CacheDataLoader, LoaderStats
from .torch.fetcher import Fetcher, FetcherStats
from .torch.streaming import StreamingDataset
from .upload import UploadSummary, upload

__all__ = [
    "AsyncCacheError",
    "AuthError",
    "BadIndexError",
    "BadMagicError",
    "BridgeError",
    "Cache",
    "CacheDataLoader",
    "CacheError",
    "CacheNotFilledError",
    "ChecksumMismatchError",
    "ConfigError",
    "CorruptIndexError",
    "DataError",
    "DatasetExistsError",
    "DiskFullError",
    "DownloadStats",
    "Fetcher",
    "FetcherStats",
    "InputFailedError",
    "LoaderStats",
    "ObjectNotFoundError",
    "OptimizeResult",
    "ResumeStateError",
    "RetriesExhaustedError",
    "SerializationError",
    "Settings",
    "StorageError",
    "StorageTimeoutError",
    "StreamingDataset",
    "TransientError",
    "TruncatedChunkError",
    "UnsafePathError",
    "UnsupportedVersionError",
    "UploadSummary",
    "WorkerDiedError",
    "WriteConflictError",
    "__version__",
    "optimize",
    "prefetch",
    "upload",
]
