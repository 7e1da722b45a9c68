"""asynccache: train PyTorch models on datasets that live in object storage."""

__version__ = "0.1.0"

from .errors import (
    AsyncCacheError,
    AuthError,
    BadIndexError,
    BadMagicError,
    BridgeError,
    CacheError,
    ChecksumMismatchError,
    ConfigError,
    DataError,
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
)
from .torch.cache import Cache, CacheNotFilledError
from .torch.dataloader import CacheDataLoader

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
    "DataError",
    "ObjectNotFoundError",
    "ResumeStateError",
    "RetriesExhaustedError",
    "SerializationError",
    "StorageError",
    "StorageTimeoutError",
    "TransientError",
    "TruncatedChunkError",
    "UnsafePathError",
    "UnsupportedVersionError",
    "__version__",
]
