"""asynccache: train PyTorch models on datasets that live in object storage."""

__version__ = "0.1.0"
