"""Storage backends, one per URL scheme, behind the async :class:`Storage` contract."""

from .base import ObjectInfo, Storage
from .factory import open_storage
from .http import HttpStorage
from .local import LocalStorage
from .s3 import S3Storage

__all__ = ["HttpStorage", "LocalStorage", "ObjectInfo", "S3Storage", "Storage", "open_storage"]
