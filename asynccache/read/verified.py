"""Which files of a local dataset's chunks a checksum passed for, shared by the processes
that read one dataset (a dataset and its DataLoader workers).

A :class:`Reader` of a local dataset hashes each chunk the first time it maps it. Each
epoch's new DataLoader workers would hash every chunk again; with a table shared by the
dataset and its workers a chunk is hashed once for all of them. An entry names the file,
not the chunk: a file put at the chunk's path later (a rewritten dataset's) matches no
entry and is hashed again.

The table lives in memory the caller shares (``view_of(storage)``: zero bytes, rows of
:data:`ROW` words): a forked worker inherits it, a spawned one gets it with the dataset
(``storage`` is what pickles; ``view_of(storage)`` makes the view again). No lock: a word
is written whole, the chunk's number last, and a row torn by two writers holds words of
verified files only, which together name no file unless every word is that file's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ROW", "FileId", "VerifiedFiles"]

ROW = 6  # chunk number + 1, device, inode, size, modification and change time (ns)
_MASK = (1 << 64) - 1

FileId = tuple[int, int, int, int, int]


class VerifiedFiles:
    """A table of ``len(view) // ROW`` rows; chunk ``ci`` has row ``ci % rows`` (a chunk
    whose row another took is hashed again, as without the table). Words are stored
    modulo 2**64 (a ``uint64`` view)."""

    def __init__(self, storage: Any, view_of: Callable[[Any], np.ndarray]) -> None:
        self._storage, self._view_of = storage, view_of
        self._rows = view_of(storage).view(np.uint64).reshape(-1, ROW)

    def holds(self, ci: int, ident: FileId) -> bool:
        """A checksum passed for file ``ident`` of chunk ``ci`` (as far as the table
        remembers)."""
        row = self._rows[ci % len(self._rows)].tolist()
        return row[0] == ci + 1 and row[1:] == [v & _MASK for v in ident]

    def put(self, ci: int, ident: FileId) -> None:
        """A checksum passed for file ``ident`` of chunk ``ci``."""
        row = self._rows[ci % len(self._rows)]
        row[0] = 0  # (a reader meanwhile finds no entry, or words of verified files)
        row[1:] = [v & _MASK for v in ident]
        row[0] = ci + 1

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self._storage, "view_of": self._view_of}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], state["view_of"])  # type: ignore[misc]
