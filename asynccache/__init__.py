"""asynccache: train PyTorch models on datasets that live in object storage."""

import typing

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
    CorruptFooterError,
    CorruptIndexError,
    DataError,
    DatasetExistsError,
    DatasetRewrittenError,
    DiskFullError,
    InputFailedError,
    InputTimeoutError,
    ObjectNotFoundError,
    ResumeStateError,
    RetriesExhaustedError,
    SchemaMismatchError,
    SerializationError,
    StorageError,
    StorageTimeoutError,
    ThrottledError,
    ThrottleTimeoutError,
    TransientError,
    TruncatedChunkError,
    UnsafePathError,
    UnsupportedVersionError,
    WorkerDiedError,
    WorkerStartError,
    WriteConflictError,
)
from .format.images import DecodeImages
from .optimize import OptimizeResult, optimize
from .read.prefetch import prefetch
from .read.token_blocks import TokenBlocks
from .write.upload import UploadSummary, upload

if typing.TYPE_CHECKING:
    from .torch.cache import Cache, CacheNotFilledError
    from .torch.dataloader import CacheDataLoader
    from .torch.fetcher import Fetcher, FetcherStats
    from .torch.loader_stats import LoaderStats
    from .torch.mixed import MixedDataset, Stream
    from .torch.streaming import StreamingDataset

# The torch-facing names are imported on first use, so ``import asynccache`` (and a
# process that only converts data, e.g. optimize's worker pool) does not import torch.
_LAZY = {
    "Cache": ".torch.cache",
    "CacheNotFilledError": ".torch.cache",
    "CacheDataLoader": ".torch.dataloader",
    "LoaderStats": ".torch.loader_stats",
    "Fetcher": ".torch.fetcher",
    "FetcherStats": ".torch.fetcher",
    "StreamingDataset": ".torch.streaming",
    "MixedDataset": ".torch.mixed",
    "Stream": ".torch.mixed",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "CorruptFooterError",
    "CorruptIndexError",
    "DataError",
    "DatasetExistsError",
    "DatasetRewrittenError",
    "DecodeImages",
    "DiskFullError",
    "DownloadStats",
    "Fetcher",
    "FetcherStats",
    "InputFailedError",
    "InputTimeoutError",
    "LoaderStats",
    "MixedDataset",
    "ObjectNotFoundError",
    "OptimizeResult",
    "ResumeStateError",
    "RetriesExhaustedError",
    "SchemaMismatchError",
    "SerializationError",
    "Settings",
    "StorageError",
    "StorageTimeoutError",
    "Stream",
    "StreamingDataset",
    "ThrottleTimeoutError",
    "ThrottledError",
    "TokenBlocks",
    "TransientError",
    "TruncatedChunkError",
    "UnsafePathError",
    "UnsupportedVersionError",
    "UploadSummary",
    "WorkerDiedError",
    "WorkerStartError",
    "WriteConflictError",
    "__version__",
    "optimize",
    "prefetch",
    "upload",
]
