"""Storage backends, one per URL scheme, behind the async :class:`Storage` contract."""

from .base import ObjectInfo, Storage
from .factory import open_storage
from .http import HttpStorage
from .local import LocalStorage

#: Backends imported on demand: each needs its optional extra (s3, gcs, azure, hf).
_OPTIONAL = {
    "S3Storage": ".s3",
    "GcsStorage": ".gcs",
    "AzureStorage": ".azure",
    "HfStorage": ".hf",
}


def __getattr__(name: str) -> object:
    if name in _OPTIONAL:
        import importlib

        return getattr(importlib.import_module(_OPTIONAL[name], __name__), name)
    raise AttributeError(name)


__all__ = [
    "AzureStorage",
    "GcsStorage",
    "HfStorage",
    "HttpStorage",
    "LocalStorage",
    "ObjectInfo",
    "S3Storage",
    "Storage",
    "open_storage",
]
