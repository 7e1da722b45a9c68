"""The on-disk format: items, chunk files and ``index.json``. Pure: no I/O, no threads.

Specified byte by byte in ``docs/format.md``.
"""

from .chunk import MAGIC, VERSION, ChunkView, build
from .index import INDEX_NAME, ChunkEntry, Index, check_filename, checksum, merge, runs
from .items import decode, encode, encoded_size

__all__ = [
    "INDEX_NAME",
    "MAGIC",
    "VERSION",
    "ChunkEntry",
    "ChunkView",
    "Index",
    "build",
    "check_filename",
    "checksum",
    "decode",
    "encode",
    "encoded_size",
    "merge",
    "runs",
]
