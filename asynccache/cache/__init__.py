"""The local cache directory: layout, cross-process locks, atomic publish, pins, LRU eviction."""

from .eviction import Entry, select_victims
from .layout import TempFile, dataset_dir, sweep_orphans
from .locks import FileLock
from .store import ChunkStore

__all__ = [
    "ChunkStore",
    "Entry",
    "FileLock",
    "TempFile",
    "dataset_dir",
    "select_victims",
    "sweep_orphans",
]
