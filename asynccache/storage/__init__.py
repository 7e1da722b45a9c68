"""Storage backends, one per URL scheme, behind the async :class:`Storage` contract."""

from .base import ObjectInfo, Storage
from .factory import open_storage
from .http import HttpStorage
from .local import LocalStorage


def __getattr__(name: str) -> object:
    if name == "S3Storage":  # imported on demand: it needs the optional botocore
        from .s3 import S3Storage

        return S3Storage
    raise AttributeError(name)


__all__ = ["HttpStorage", "LocalStorage", "ObjectInfo", "S3Storage", "Storage", "open_storage"]
